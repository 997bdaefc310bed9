#!/usr/bin/env bash
# Removes the superseded images this cluster's scripts made, from the cluster's containerd
# and from podman: a new build supersedes them and the greenroom image is GBs. Only names
# that start with one of the PREFIXes (the tags these scripts make, e.g.
# localhost/greenroom:ci-) go, so a user's own tags of the same repository stay.
# containerd's CRI plugin names every image a second time by its ID (sha256:...); the
# names that share a removed tag's manifest digest go with it.
# Usage: scripts/k8s/prune-images.sh CONTAINERD_SOCKET KEEP_IMAGE PREFIX...
set -euo pipefail
[ "$#" -ge 3 ] || { echo "usage: scripts/k8s/prune-images.sh CONTAINERD_SOCKET KEEP_IMAGE PREFIX..." >&2; exit 2; }
socket=$1 keep=$2
shift 2
prefixes="$*"
ctr=(ctr --address "$socket" --namespace k8s.io)
"${ctr[@]}" images ls | awk -v keep="$keep" -v prefixes="$prefixes" '
  function superseded(n,   i, p) {
    if (n == keep) return 0
    split(prefixes, p, " ")
    for (i in p) if (index(n, p[i]) == 1) return 1
    return 0
  }
  NR > 1 {name[NR] = $1; digest[NR] = $3; if (superseded($1)) stale[$3] = 1}
  END {for (i in name) if ((digest[i] in stale) && name[i] != keep) print name[i]}' |
  xargs -r "${ctr[@]}" images rm >/dev/null
for prefix in "$@"; do
  STORAGE_DRIVER=vfs podman images --format '{{.Repository}}:{{.Tag}}' "${prefix%%:*}" |
    awk -v prefix="$prefix" -v keep="$keep" 'index($0, prefix) == 1 && $0 != keep' |
    xargs -r env STORAGE_DRIVER=vfs podman rmi -f >/dev/null
done
