#!/usr/bin/env bash
# Runs a command with the test services (the local Slurm cluster) up, and stops
# them afterwards whatever the command's outcome.
set -uo pipefail
cd "$(dirname "$0")/.."
started=()
for svc in scripts/services.d/*.sh; do
  [ -e "$svc" ] || continue
  if bash "$svc" start; then started+=("$svc"); fi
done
stop_all() { for svc in "${started[@]}"; do bash "$svc" stop || true; done; }
trap stop_all EXIT
"$@"
