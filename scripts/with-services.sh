#!/usr/bin/env bash
# Runs a command with the test services (the local Slurm cluster, Kubernetes) up, and stops
# them afterwards whatever the command's outcome.
# One run at a time per checkout: the services live in this checkout's .run/, and a second
# run would find the first's "already running", then stop them under it when it ends. A
# second run waits for the lock (fd 9, held by this shell only: the services and the
# command get it closed, so a daemon never keeps it).
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
mkdir -p .run
exec 9>.run/with-services.lock
if ! flock -n 9; then
  echo "with-services: another run in this checkout has the services; waiting for it to end" >&2
  flock 9
fi
# The services start side by side (Kubernetes waits on its pods for tens of seconds,
# Slurm on its nodes); each one that started is stopped at the end.
svcs=() pids=() started=()
for svc in scripts/services.d/*.sh; do
  [ -e "$svc" ] || continue
  bash "$svc" start 9>&- &
  svcs+=("$svc") pids+=("$!")
done
for i in "${!svcs[@]}"; do
  if wait "${pids[$i]}"; then started+=("${svcs[$i]}"); fi
done
stop_all() { for svc in "${started[@]}"; do bash "$svc" stop 9>&- || true; done; }
trap stop_all EXIT
"$@" 9>&-
