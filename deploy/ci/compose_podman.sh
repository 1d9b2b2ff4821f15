#!/usr/bin/env bash
# deploy/compose.yaml on podman, for CI and for hosts without a registry (root; apt reachable).
# tests/e2e/test_compose_served.py drives these steps; each can also be run by hand:
#
#   compose_podman.sh prepare       deps + base + wheels + build (each step timed: "timing: ...")
#   compose_podman.sh deps          apt: podman runc catatonit netavark aardvark-dns iptables debootstrap docker-compose curl
#   compose_podman.sh base          Debian 12 root (debootstrap minbase + python3) imported as $HELIX_BASE_IMAGE
#   compose_podman.sh wheels        deploy/docker/wheels/: torch + the project's deps, with this host's pip
#   compose_podman.sh build         the project image $HELIX_IMAGE from the base and the wheelhouse
#   compose_podman.sh up            the engine (podman's Docker API + health checks), then `compose up -d`
#   compose_podman.sh compose ARG.. docker-compose on this project (ps, logs, ...)
#   compose_podman.sh pid SERVICE   the host pid of SERVICE's container (its init); also:
#                     created SERVICE, restarts SERVICE, env SERVICE, exec SERVICE CMD..., checkpoint DIR (the
#                     image's tiny checkpoint copied out, for `helixserve launch` on the host)
#   compose_podman.sh down          `compose down -v`, stop the engine; exit 1 naming any leftover
#
# Why docker-compose against `podman system service` (not podman-compose): Debian's podman-compose
# (1.0.3) does not wait on `depends_on: condition: service_healthy`; docker-compose does, through
# podman's Docker-compatible API, and it is the compose CI already validates the file with.
# Without systemd, podman schedules no health checks (it asks systemd for timers), so `up` starts
# a ticker that runs `podman healthcheck run` on the project's containers every
# $HELIX_HEALTH_TICK_S (the compose interval, 5 s; each result: $STATE/health.log); retries and
# start_period are podman's own.
# Engine settings live in $STATE/containers.conf (CONTAINERS_CONF), not /etc: runc (crun fails on
# hybrid cgroups), cgroupfs (no systemd), rlimits the host allows, netavark (service-name DNS).
#
# Variables: HELIX_CI_STATE (state dir, default /var/tmp/helixserve-ci), COMPOSE_PROJECT_NAME
# (default helixci), HELIX_BASE_IMAGE, HELIX_IMAGE (default helixserve:cpu, compose's default),
# HELIX_PYTHON (whose pip makes the wheelhouse; default python3), HELIX_DEBIAN_MIRROR,
# HELIX_UP_TIMEOUT_S (300), and compose's own: HELIX_PORT, HELIX_INTERNAL_ENV_FILE, HELIX_ENV_FILE.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
STATE=${HELIX_CI_STATE:-/var/tmp/helixserve-ci}
PROJECT=${COMPOSE_PROJECT_NAME:-helixci}
BASE_IMAGE=${HELIX_BASE_IMAGE:-localhost/helixserve-base:bookworm}
export HELIX_IMAGE=${HELIX_IMAGE:-helixserve:cpu}
PYTHON=${HELIX_PYTHON:-python3}
MIRROR=${HELIX_DEBIAN_MIRROR:-http://deb.debian.org/debian}
TICK_S=${HELIX_HEALTH_TICK_S:-5}
UP_TIMEOUT_S=${HELIX_UP_TIMEOUT_S:-300}
WHEELS=$REPO/deploy/docker/wheels
SOCK=$STATE/podman.sock
COMPOSE_FILE=$REPO/deploy/compose.yaml
LABEL=com.docker.compose.project=$PROJECT

mkdir -p "$STATE"
export CONTAINERS_CONF=$STATE/containers.conf
export DOCKER_HOST=unix://$SOCK
export COMPOSE_PROJECT_NAME=$PROJECT

log() { echo "compose_podman: $*" >&2; }
die() { log "FAILED: $*"; exit 1; }

timed() {  # timed NAME CMD...: run CMD, print "timing: NAME <seconds>"
    local name=$1 start=$SECONDS
    shift
    "$@"
    echo "timing: $name $((SECONDS - start)) s"
}

probe_limit() {  # probe_limit nofile|nproc: the highest of (host hard limit, 65536, 32768, ...) runc may set
    local name=$1 hard other candidate
    if [ "$name" = nofile ]; then hard=$(ulimit -Hn); other=nproc; else hard=$(ulimit -Hu); other=nofile; fi
    for candidate in "$hard" 65536 32768 16384 4096 1024; do
        [ "$candidate" = unlimited ] && continue
        [ "$hard" != unlimited ] && [ "$candidate" -gt "$hard" ] && continue
        if podman run --rm --network none --ulimit "$other=1024:1024" --ulimit "$name=$candidate:$candidate" \
                "$BASE_IMAGE" true >/dev/null 2>&1; then
            echo "$candidate"
            return
        fi
    done
    die "no $name limit that runc may set (tried up to $hard)"
}

ulimits() {  # "NOFILE NPROC": podman's defaults (1048576) exceed what runc may set in some sandboxes
    if [ ! -s "$STATE/ulimits" ]; then
        podman image exists "$BASE_IMAGE" || die "no base image $BASE_IMAGE to probe rlimits with (run: $0 base)"
        local limits
        limits="$(probe_limit nofile) $(probe_limit nproc)"
        [[ $limits =~ ^[0-9]+\ [0-9]+$ ]] || die "rlimit probe: $limits"
        echo "$limits" > "$STATE/ulimits"
        log "rlimits runc may set here: $(cat "$STATE/ulimits") (nofile nproc)"
    fi
    cat "$STATE/ulimits"
}

write_conf() {  # write_conf [with-ulimits]
    local limits=""
    if [ -n "${1:-}" ]; then
        local nofile nproc
        read -r nofile nproc < <(ulimits)
        limits="default_ulimits = [\"nofile=$nofile:$nofile\", \"nproc=$nproc:$nproc\"]"
    fi
    cat > "$CONTAINERS_CONF" <<EOF
# written by deploy/ci/compose_podman.sh (CONTAINERS_CONF of its podman commands only)
[containers]
$limits
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
[network]
network_backend = "netavark"
EOF
}

step_deps() {
    # iptables: netavark programs the bridge's NAT with it (without it a build's RUN step fails
    # with "netavark: No such file or directory")
    bash "$REPO/deploy/ci/install_system_deps.sh" podman runc catatonit netavark aardvark-dns iptables \
        debootstrap docker-compose curl
    write_conf
}

step_base() {
    if [ -z "${HELIX_REBUILD_BASE:-}" ] && podman image exists "$BASE_IMAGE"; then
        log "base image $BASE_IMAGE exists (HELIX_REBUILD_BASE=1 remakes it)"
        return
    fi
    local root=$STATE/rootfs
    rm -rf "$root"
    log "debootstrap bookworm from $MIRROR (log: $STATE/debootstrap.log)"
    debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$MIRROR" \
        > "$STATE/debootstrap.log" 2>&1 || { tail -20 "$STATE/debootstrap.log" >&2; die "debootstrap"; }
    rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
    tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE_IMAGE" >/dev/null
    rm -rf "$root" "$STATE/ulimits"
}

step_wheels() {
    # the project's requirements, the default image's extras (the Dockerfile's PIP_EXTRAS) and build
    # requirements from pyproject (no project build here); torch pinned to the Dockerfile's
    # TORCH_VERSION (pyproject's range would let pip pick a multi-GB CUDA build)
    local reqs=$STATE/requirements.txt
    "$PYTHON" - "$REPO/pyproject.toml" "$REPO/deploy/docker/Dockerfile" > "$reqs" <<'EOF'
import re, sys, tomllib
data = tomllib.load(open(sys.argv[1], "rb"))
dockerfile = open(sys.argv[2]).read()
torch = re.search(r"^ARG TORCH_VERSION=(\S+)", dockerfile, re.M).group(1)
extras = re.search(r'^ARG PIP_EXTRAS="\[?([^"\]]*)\]?"', dockerfile, re.M).group(1)
optional = data["project"].get("optional-dependencies", {})
reqs = [*data["build-system"]["requires"], *data["project"]["dependencies"]]
reqs += [r for extra in filter(None, extras.split(",")) for r in optional[extra.strip()]]
for req in reqs:
    print(f"torch=={torch}" if re.match(r"torch\b", req) else req)
EOF
    log "pip wheel into $WHEELS ($("$PYTHON" -m pip --version | cut -d' ' -f1-2); $(wc -l < "$reqs") requirements)"
    "$PYTHON" -m pip wheel -q --wheel-dir "$WHEELS" -r "$reqs"
    compgen -G "$WHEELS/torch-*.whl" >/dev/null || die "no torch wheel in $WHEELS"
}

step_build() {
    podman image exists "$BASE_IMAGE" || die "no base image $BASE_IMAGE (run: $0 base)"
    local nofile nproc
    read -r nofile nproc < <(ulimits)
    # `podman build` does not apply containers.conf's default_ulimits to its RUN steps
    podman build --format docker --ulimit "nofile=$nofile:$nofile" --ulimit "nproc=$nproc:$nproc" --file "$REPO/deploy/docker/Dockerfile" \
        --build-arg BASE_IMAGE="$BASE_IMAGE" --tag "$HELIX_IMAGE" "$REPO"
}

container_id() {  # container_id SERVICE: the running container of SERVICE in this project
    [ -n "$1" ] || die "no service named"
    local id
    id=$(podman ps -q --filter "label=$LABEL" --filter "label=com.docker.compose.service=$1")
    [ -n "$id" ] || die "no running container of service $1"
    echo "$id"
}

compose() {
    docker-compose --project-name "$PROJECT" --file "$COMPOSE_FILE" "$@"
}

health_ticker() {  # what systemd's timers do for podman elsewhere
    while true; do
        local ids
        ids=$(podman ps -q --filter "label=$LABEL" 2>/dev/null || true)
        for id in $ids; do
            (
                name=$(podman inspect --format '{{.Name}}' "$id" 2>/dev/null) || exit 0
                result=failing
                timeout 30 podman healthcheck run "$id" >/dev/null 2>&1 && result=healthy
                echo "$(date +%s.%N) $name $result" >> "$STATE/health.log"
            ) &
        done
        wait
        sleep "$TICK_S"
    done
}

engine_start() {
    write_conf with-ulimits
    engine_stop
    rm -f "$SOCK"
    podman system service --time=0 "unix://$SOCK" > "$STATE/service.log" 2>&1 &
    echo $! > "$STATE/service.pid"
    local deadline=$((SECONDS + 30))
    until curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1; do
        [ $SECONDS -lt $deadline ] || { cat "$STATE/service.log" >&2; die "podman system service: no answer in 30 s"; }
        sleep 0.2
    done
    if [ ! -S /run/systemd/private ]; then
        health_ticker > /dev/null 2>&1 &
        echo $! > "$STATE/ticker.pid"
        log "no systemd: health checks by the ticker (every ${TICK_S} s)"
    fi
}

stop_pidfile() {  # stop_pidfile FILE PATTERN: stop the process we started, if FILE's pid is still it
    local file=$1 pattern=$2 pid
    [ -f "$file" ] || return 0
    pid=$(cat "$file")
    rm -f "$file"
    # a pid left by an earlier boot may be another process's by now: match its command line
    tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$pattern" || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
}

engine_stop() {
    stop_pidfile "$STATE/ticker.pid" "compose_podman.sh"
    stop_pidfile "$STATE/service.pid" "system service --time=0 unix://$SOCK"
}

step_up() {
    engine_start  # stops the engine a killed earlier run left (its pid files are in $STATE)
    : > "$STATE/health.log"
    # what a killed earlier run may have left of this project
    compose down --volumes --remove-orphans --timeout 5 >/dev/null 2>&1 || true
    # a failed or interrupted `up` leaves nothing running
    trap 'log "interrupted: taking the project down"; step_down || true; exit 130' INT TERM
    log "compose up (docker-compose $(docker-compose version --short) -> podman $(podman version --format '{{.Server.Version}}'))"
    # compose waits for the workers' health; a service that exits meanwhile fails the step at once
    docker-compose --project-name "$PROJECT" --file "$COMPOSE_FILE" up --detach --no-build &
    local up_pid=$! deadline=$((SECONDS + UP_TIMEOUT_S)) failure=""
    while kill -0 "$up_pid" 2>/dev/null; do
        if [ $SECONDS -ge $deadline ]; then
            failure="not up in ${UP_TIMEOUT_S} s"
        else
            failure=$(podman ps -a --filter "label=$LABEL" --format '{{.ID}}' | while read -r id; do
                podman inspect --format '{{.Name}} {{.State.Status}} {{.RestartCount}}' "$id"
            done | awk '$2 == "exited" || $3 > 0 {printf "%s (%s, restarts %s) ", $1, $2, $3}')
        fi
        if [ -n "$failure" ]; then
            kill "$up_pid" 2>/dev/null || true
            break
        fi
        sleep 1
    done
    local rc=0
    wait "$up_pid" || rc=$?
    if [ -n "$failure" ] || [ $rc -ne 0 ]; then
        compose ps >&2 || true
        compose logs --no-color --tail 40 >&2 || true
        log "compose up failed: taking the project down"
        step_down >&2 || true
        die "compose up: ${failure:-docker-compose exited $rc}"
    fi
    trap - INT TERM
}

leftovers() {
    {
        podman ps -a --filter "label=$LABEL" --format 'container {{.Names}}'
        podman network ls --filter "label=$LABEL" --format 'network {{.Name}}'
        podman network ls --format 'network {{.Name}}' | grep -x "network ${PROJECT}_default" || true
        podman volume ls --filter "label=$LABEL" --format 'volume {{.Name}}'
    } | sort -u
}

step_down() {
    local rc=0 left
    if curl -sf --unix-socket "$SOCK" http://d/_ping >/dev/null 2>&1; then
        timeout 120 docker-compose --project-name "$PROJECT" --file "$COMPOSE_FILE" \
            down --volumes --remove-orphans --timeout 30 || { log "compose down failed"; rc=1; }
    else
        log "no engine running: nothing for compose down"
    fi
    engine_stop
    left=$(leftovers)
    if [ -n "$left" ]; then
        log "left after down:"$'\n'"$left"
        podman rm -f $(podman ps -aq --filter "label=$LABEL") >/dev/null 2>&1 || true
        podman network rm -f "${PROJECT}_default" >/dev/null 2>&1 || true
        podman volume rm -f $(podman volume ls -q --filter "label=$LABEL") >/dev/null 2>&1 || true
        rc=1
    fi
    return $rc
}

# podman refuses to start without the file CONTAINERS_CONF names: the settings without rlimits
# until the base image exists to probe them with
[ -f "$CONTAINERS_CONF" ] || write_conf

case "${1:-}" in
    deps) timed deps step_deps ;;
    base) timed base step_base; write_conf with-ulimits ;;
    wheels) timed wheels step_wheels ;;
    build) timed build step_build ;;
    prepare)
        timed deps step_deps
        timed base step_base
        write_conf with-ulimits
        timed wheels step_wheels
        timed build step_build
        ;;
    up) timed up step_up ;;
    compose) shift; compose "$@" ;;
    pid) podman inspect --format '{{.State.Pid}}' "$(container_id "${2:-}")" ;;
    created) podman inspect --format '{{.Created.UnixNano}}' "$(container_id "${2:-}")" ;;
    restarts) podman inspect --format '{{.RestartCount}}' "$(container_id "${2:-}")" ;;
    env) podman inspect --format '{{range .Config.Env}}{{println .}}{{end}}' "$(container_id "${2:-}")" ;;
    exec) id=$(container_id "${2:-}"); shift 2; podman exec "$id" "$@" ;;
    checkpoint)  # checkpoint DIR: the image's baked tiny checkpoint, copied to DIR/kimi-k3-tiny
        [ -n "${2:-}" ] || die "usage: $0 checkpoint DIR"
        mkdir -p "$2"
        podman run --rm --network none --user 0 --entrypoint tar "$HELIX_IMAGE" \
            -C /opt/helixserve/models -c kimi-k3-tiny | tar -C "$2" -x
        ;;
    down) step_down ;;
    leftovers) leftovers ;;
    *) sed -n '2,16p' "$0" >&2; exit 2 ;;
esac
