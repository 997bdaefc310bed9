#!/usr/bin/env bash
# Installs a single-host Slurm (slurmctld, slurmd, client tools) and munge for the
# Slurm tests. Idempotent; when it cannot run (not root, no apt) it says why and
# exits 0 so the Slurm tests skip with that reason instead of failing the suite.
set -euo pipefail
packages=(slurmctld slurmd slurm-client munge)
if [ "$(id -u)" -ne 0 ]; then
  echo "10-slurm: not root, not installing ${packages[*]} (the Slurm tests will skip)"
  exit 0
fi
if ! command -v apt-get >/dev/null || [ ! -r /etc/debian_version ]; then
  echo "10-slurm: not a Debian system with apt-get, not installing ${packages[*]} (the Slurm tests will skip)"
  exit 0
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "10-slurm: ${packages[*]} already installed"
  exit 0
fi
echo "10-slurm: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || { echo "10-slurm: apt-get update failed (the Slurm tests will skip)"; exit 0; }
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || { echo "10-slurm: apt-get install failed (the Slurm tests will skip)"; exit 0; }
# The Debian units would start the daemons against /etc/slurm; scripts/services.d/slurm.sh
# starts its own with a generated config, so stop any the package started.
if command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
  systemctl disable --now slurmctld slurmd >/dev/null 2>&1 || true
fi
echo "10-slurm: installed"
