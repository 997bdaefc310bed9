#!/usr/bin/env bash
# Builds the greenroom image the test cluster's pods run and imports it into the cluster's
# containerd: images/Dockerfile through scripts/build-image.sh (what `make image` runs), on
# the debootstrap Debian base of images/ci-base.sh, as CI builds it. No registry is
# reachable, so every wheel the build installs is staged on the host first
# (images/stage_wheels.py: PyPI's CUDA torch with its nvidia-* runtime wheels, which import
# on a CPU node) and pip inside the build uses only those.
#
# Cached outside the checkout, so a warm start pays nothing: the wheels in
# ~/.cache/greenroom-k8s/wheels, the image in containerd's store (node.sh keeps it under
# ~/.cache/greenroom-k8s/containerd). The tag is a hash of what goes into the image (the
# tracked sources, uncommitted changes, the staged versions): an unchanged tree finds its
# image already imported. podman's copy is removed once containerd has it (vfs stores each
# layer whole: the image is GBs), and so are the images of earlier tags
# (scripts/k8s/prune-images.sh).
# Usage: scripts/k8s/image.sh CONTAINERD_SOCKET   (prints the image name on its last line)
set -euo pipefail
[ "$#" -eq 1 ] || { echo "usage: scripts/k8s/image.sh CONTAINERD_SOCKET" >&2; exit 2; }
socket=$1
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python

wheels="${GREENROOM_K8S_CACHE:-$HOME/.cache/greenroom-k8s}/wheels"
"$python" images/stage_wheels.py "$wheels" >&2
sources=(runtime pyproject.toml README.md images scripts/build-image.sh scripts/k8s/image.sh)
tag=$( (git ls-files -s "${sources[@]}"; git diff HEAD -- "${sources[@]}"; cat "$wheels/.staged") |
       sha256sum | cut -c1-12)
repository=localhost/greenroom
image=$repository:k8s-$tag
base=localhost/greenroom-ci-base:bookworm
# This machine's podman: vfs storage and chroot isolation (overlay and the default
# isolation fail on its cgroups); no intermediate layers (with vfs each is a full copy).
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot BUILDAH_LAYERS=false
ctr=(ctr --address "$socket" --namespace k8s.io)

if ! "${ctr[@]}" images ls -q "name==$image" | grep -q .; then
  if ! podman image exists "$image"; then
    bash images/ci-base.sh "$base" >&2
    # A CPU image: no nvcomp extra (its CUDA codec has nothing to run on here).
    GREENROOM_BUILD_ENGINE=podman GREENROOM_IMAGE_WHEELS="$wheels" GREENROOM_PIP_NO_INDEX=1 \
      GREENROOM_IMAGE_EXTRAS="" scripts/build-image.sh "$image" "$base" >&2
  fi
  podman save --format docker-archive "$image" | "${ctr[@]}" images import - >/dev/null
  podman rmi -f "$image" >/dev/null
fi
# Earlier tags of this image: each is GBs.
scripts/k8s/prune-images.sh "$socket" "$repository" "$image"
echo "$image"
