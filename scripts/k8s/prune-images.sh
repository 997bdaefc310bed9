#!/usr/bin/env bash
# Removes the other tags of an image repository this cluster made, from the cluster's
# containerd and from podman: a new build supersedes them and the greenroom image is GBs.
# containerd's CRI plugin names every image a second time by its ID (sha256:...); the
# names that share a removed tag's manifest digest go with it.
# Usage: scripts/k8s/prune-images.sh CONTAINERD_SOCKET REPOSITORY KEEP_IMAGE
set -euo pipefail
[ "$#" -eq 3 ] || { echo "usage: scripts/k8s/prune-images.sh CONTAINERD_SOCKET REPOSITORY KEEP_IMAGE" >&2; exit 2; }
socket=$1 repository=$2 keep=$3
ctr=(ctr --address "$socket" --namespace k8s.io)
"${ctr[@]}" images ls | awk -v keep="$keep" -v repo="$repository:" '
  NR > 1 {name[NR] = $1; digest[NR] = $3; if (index($1, repo) == 1 && $1 != keep) stale[$3] = 1}
  END {for (i in name) if ((digest[i] in stale) && name[i] != keep) print name[i]}' |
  xargs -r "${ctr[@]}" images rm >/dev/null
STORAGE_DRIVER=vfs podman images --format '{{.Repository}}:{{.Tag}}' "$repository" |
  awk -v repo="$repository:" -v keep="$keep" 'index($0, repo) == 1 && $0 != keep' |
  xargs -r env STORAGE_DRIVER=vfs podman rmi -f >/dev/null
