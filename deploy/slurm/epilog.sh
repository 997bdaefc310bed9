#!/bin/bash
# Example Slurm Epilog for admins who want the cluster itself to reclaim greenroom's
# per-rank files after every job, whatever killed it. slurm.conf:
#   Epilog=/etc/slurm/epilog.d/greenroom.sh
# It runs as root on each of the job's nodes once the job's processes are gone, so the
# job's own dirs are unlocked and go; a job still running on the node holds its locks
# and keeps its files. An Epilog that fails drains the node: always exit 0.
scratch=/local/nvme                         # the node-local scratch the jobs use
greenroom=/opt/greenroom/venv/bin/greenroom # a greenroom install on the node
for root in "$scratch"/greenroom_train_offload_*; do
  [ -d "$root" ] || continue
  "$greenroom" reclaim "$root" >/dev/null 2>&1 || logger -t greenroom-epilog "reclaim $root failed"
done
exit 0
