#!/usr/bin/env bash
# Imports the greenroom image the test cluster's pods run into the cluster's containerd:
# the CI image of images/ci-image.sh (images/Dockerfile through scripts/build-image.sh, what
# `make image` runs, on the debootstrap Debian base, with staged wheels), the same build
# tests/test_image.py runs with podman. The import is skipped when containerd already has
# that tag (its store is kept under ~/.cache/greenroom-k8s/containerd, node.sh), so a warm
# start pays nothing; earlier tags are removed from containerd (each is GBs,
# scripts/k8s/prune-images.sh). podman keeps its copy: tests/test_image.py runs it.
# Usage: scripts/k8s/image.sh CONTAINERD_SOCKET   (prints the image name on its last line)
set -euo pipefail
[ "$#" -eq 1 ] || { echo "usage: scripts/k8s/image.sh CONTAINERD_SOCKET" >&2; exit 2; }
socket=$1
cd "$(dirname "$0")/../.."
ctr=(ctr --address "$socket" --namespace k8s.io)

image=$(images/ci-image.sh | tail -1)
if ! "${ctr[@]}" images ls -q "name==$image" | grep -q .; then
  STORAGE_DRIVER=vfs podman save --format docker-archive "$image" | "${ctr[@]}" images import - >/dev/null
fi
# localhost/greenroom:k8s-: the tags this script made before images/ci-image.sh.
scripts/k8s/prune-images.sh "$socket" "$image" localhost/greenroom:ci- localhost/greenroom:k8s-
echo "$image"
