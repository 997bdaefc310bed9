#!/usr/bin/env bash
# Installs Slurm (slurmctld, slurmd, client tools), munge and iproute2 (for the namespaced
# nodes of scripts/services.d/slurm.sh) for the Slurm tests (see scripts/lib/apt-install.sh
# for what happens when it cannot).
set -euo pipefail
# shellcheck source=scripts/lib/apt-install.sh
source "$(dirname "$0")/../lib/apt-install.sh"
apt_install 10-slurm "the Slurm tests will skip" slurmctld slurmd slurm-client munge iproute2
# The Debian units would start the daemons against /etc/slurm; scripts/services.d/slurm.sh
# starts its own with a generated config, so stop any the package started.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  systemctl disable --now slurmctld slurmd >/dev/null 2>&1 || true
fi
