#!/usr/bin/env bash
# Stop the test cluster started by start.sh DIR and remove DIR.
#
# Usage: deploy/slurm/testing/stop.sh DIR [--keep]
#   1. cancels every job and waits (bounded) for them to leave the queue,
#   2. stops slurmd, slurmctld and munged (SIGTERM, then SIGKILL after a bound),
#   3. kills what is left of this cluster, by pid: slurmstepd processes logging into DIR and any
#      process whose environment names this cluster's SLURM_CONF together with a SLURM_JOB_ID,
#   4. removes DIR (kept with --keep, e.g. to read DIR/log after a failure).
# Exit status 0 when nothing of the cluster is left running, 1 otherwise.
# Environment: SLURM_TEST_WAIT_S bounds each wait (default 30).
set -uo pipefail

dir="${1:?usage: stop.sh DIR [--keep]}"
keep="${2:-}"
if [ ! -d "$dir" ]; then
    echo "stop.sh: $dir does not exist; nothing to stop" >&2
    exit 0
fi
dir="$(cd "$dir" && pwd)"
wait_s="${SLURM_TEST_WAIT_S:-30}"
conf="$dir/etc/slurm.conf"
export SLURM_CONF="$conf"

alive() {  # running, not a zombie waiting to be reaped
    [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null \
        && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]
}
pid_of() { [ -s "$dir/$1.pid" ] && cat "$dir/$1.pid"; }

wait_gone() {  # wait_gone SECONDS PID...; returns 1 if any is still alive at the bound
    local bound=$(( $(date +%s) + $1 )); shift
    while :; do
        local any=0
        for p in "$@"; do alive "$p" && any=1; done
        [ "$any" = 0 ] && return 0
        [ "$(date +%s)" -ge "$bound" ] && return 1
        sleep 0.2
    done
}

# pids of this cluster's job processes and step daemons (never this script or its ancestors)
cluster_pids() {
    local skip=" $$ " p=$$
    while [ "$p" -gt 1 ] 2>/dev/null; do
        p="$(awk '/^PPid:/ {print $2}' "/proc/$p/status" 2>/dev/null || echo 0)"
        skip+="$p "
    done
    for proc in /proc/[0-9]*; do
        local pid="${proc#/proc/}"
        case "$skip" in *" $pid "*) continue ;; esac
        local comm; comm="$(cat "$proc/comm" 2>/dev/null)" || continue
        if [ "$comm" = slurmstepd ]; then
            # step daemons run in slurmd's log directory and keep files of DIR open
            local mine=0 fd
            [ "$(readlink "$proc/cwd" 2>/dev/null)" = "$dir/log" ] && mine=1
            for fd in "$proc"/fd/*; do
                case "$(readlink "$fd" 2>/dev/null)" in "$dir"/*) mine=1; break ;; esac
            done
            [ "$mine" = 1 ] && echo "$pid"
            continue
        fi
        if grep -zqxF "SLURM_CONF=$conf" "$proc/environ" 2>/dev/null \
                && grep -zq '^SLURM_JOB_ID=' "$proc/environ" 2>/dev/null; then
            echo "$pid"
        fi
    done
}

started=$(date +%s.%N)
ctld="$(pid_of slurmctld || true)"
if alive "$ctld"; then
    job_ids="$(timeout 10 squeue -h -o %i 2>/dev/null | tr '\n' ' ')"
    if [ -n "${job_ids// /}" ]; then
        # shellcheck disable=SC2086
        timeout 10 scancel $job_ids 2>/dev/null
        bound=$(( $(date +%s) + wait_s ))
        while [ -n "$(timeout 10 squeue -h -o %i 2>/dev/null)" ] && [ "$(date +%s)" -lt "$bound" ]; do
            sleep 0.2
        done
    fi
fi

daemons=()
for name in slurmd slurmctld munged; do
    p="$(pid_of "$name" || true)"
    if alive "$p"; then
        kill -TERM "$p" 2>/dev/null
        daemons+=("$p")
    fi
done
if ! wait_gone "$wait_s" "${daemons[@]}"; then
    for p in "${daemons[@]}"; do alive "$p" && kill -KILL "$p" 2>/dev/null; done
    wait_gone 5 "${daemons[@]}"
fi

mapfile -t left < <(cluster_pids)
if [ "${#left[@]}" -gt 0 ]; then
    echo "stop.sh: killing leftover processes of the cluster: ${left[*]}" >&2
    kill -TERM "${left[@]}" 2>/dev/null
    wait_gone 5 "${left[@]}" || kill -KILL "${left[@]}" 2>/dev/null
    wait_gone 5 "${left[@]}"
fi
mapfile -t still < <(cluster_pids)
for name in slurmd slurmctld munged; do
    p="$(pid_of "$name" || true)"
    alive "$p" && still+=("$p")
done

elapsed="$(python3 -c "import time; print(f'{time.time() - $started:.1f}')")"
if [ "${#still[@]}" -gt 0 ]; then
    echo "stop.sh: still running after ${elapsed}s: ${still[*]}; keeping $dir" >&2
    exit 1
fi
if [ "$keep" = "--keep" ]; then
    echo "stop.sh: stopped in ${elapsed}s; kept $dir" >&2
else
    rm -rf "$dir"
    echo "stop.sh: stopped in ${elapsed}s; removed $dir" >&2
fi
exit 0
