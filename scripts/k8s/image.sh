#!/usr/bin/env bash
# Imports the greenroom image the test cluster's pods run into the cluster's containerd:
# the CI image of images/ci-image.sh (images/Dockerfile through scripts/build-image.sh, what
# `make image` runs, on the debootstrap Debian base, with staged wheels), the same build
# tests/image/test_image.py runs with podman. The import is skipped when containerd already has
# that tag (its store is kept under ~/.cache/greenroom-k8s/containerd, node.sh), so a warm
# start pays nothing; earlier tags are removed from containerd (each is GBs,
# scripts/k8s/prune-images.sh). podman keeps its copy: tests/image/test_image.py runs it.
# Usage: scripts/k8s/image.sh CONTAINERD_SOCKET   (prints the image name on its last line;
# where the disk has no room for it, why not, and exits 1)
set -euo pipefail
[ "$#" -eq 1 ] || { echo "usage: scripts/k8s/image.sh CONTAINERD_SOCKET" >&2; exit 2; }
socket=$1
cd "$(dirname "$0")/../.."
ctr=(ctr --address "$socket" --namespace k8s.io)
python=${PYTHON:-python3}

image=$(images/ci-image.sh | tail -1)
if ! "${ctr[@]}" images ls -q "name==$image" | grep -q .; then
  # Room first: the import writes the layers' blobs, then unpacks them into the snapshotter,
  # about the image's size each. A disk filled here fails every pod of the cluster, and
  # whatever else shares the disk, so refuse in one line instead, leaving a margin. The two
  # nodes' imports run at once (scripts/services.d/k8s.sh), so each import's need is held in
  # a file under $store/.imports/ while it runs, and the others in flight count against the
  # free space too.
  store="${GREENROOM_K8S_CACHE:-$HOME/.cache/greenroom-k8s}"
  size=$(STORAGE_DRIVER=vfs podman image inspect --format '{{.Size}}' "$image")
  need=$((2 * size + ${GREENROOM_K8S_FREE_MARGIN_GB:-4} * 1024 ** 3))
  mkdir -p "$store/.imports"
  exec 8>"$store/.imports/.lock"
  flock 8
  others=0
  for held in "$store/.imports"/*; do
    [ -f "$held" ] || continue
    if kill -0 "${held##*/}" 2>/dev/null; then others=$((others + $(cat "$held"))); else rm -f "$held"; fi
  done
  free=$(df -B1 --output=avail "$store" | tail -1)
  if ((free < need + others)); then
    echo "not imported: $((free >> 30)) GiB free under $store, and importing $image needs" \
      "$((need >> 30)) GiB with a margin (GREENROOM_K8S_FREE_MARGIN_GB)$( ((others == 0)) ||
      echo ", $((others >> 30)) GiB more for the imports in flight"); free space there or point" \
      "GREENROOM_K8S_CACHE at a larger disk"
    exit 1
  fi
  echo "$need" >"$store/.imports/$$"
  trap 'rm -f "$store/.imports/$$"' EXIT
  exec 8>&-
  STORAGE_DRIVER=vfs podman save --format docker-archive "$image" | "${ctr[@]}" images import - >/dev/null
  # Then the layers' blobs go: they are unpacked in the snapshotter, which is all a pod
  # uses, and containerd keeps them only to export or push the image, which the cluster
  # never does. That halves what the image takes (GBs per node); where it fails, the
  # import stands and the blobs stay.
  "${ctr[@]}" content get "$("${ctr[@]}" images ls "name==$image" | awk 'NR == 2 {print $3}')" |
    "$python" -c 'import json, sys; print("\n".join(layer["digest"] for layer in json.load(sys.stdin)["layers"]))' |
    xargs -r "${ctr[@]}" content rm >/dev/null ||
    echo "image.sh: $image is imported, but its layers' blobs could not be dropped (they stay in containerd)" >&2
fi
# localhost/greenroom:k8s-: the prefix of images built without images/ci-image.sh, pruned where they remain.
scripts/k8s/prune-images.sh "$socket" "$image" localhost/greenroom:ci- localhost/greenroom:k8s-
echo "$image"
