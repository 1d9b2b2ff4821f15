#!/usr/bin/env bash
# Install what the single-node test cluster needs (slurm-wlm, munge). Idempotent; quick when
# already installed. Usage: deploy/slurm/testing/install.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec "$here/../../ci/install_system_deps.sh" slurm-wlm munge
