#!/usr/bin/env bash
# The CI image: images/Dockerfile built by scripts/build-image.sh (what `make image` runs)
# with podman on the debootstrap Debian base of images/ci-base.sh. One build serves both
# users: tests/image/test_image.py runs it with podman, and the Kubernetes test cluster imports it
# into its containerd (scripts/k8s/image.sh). No registry is reachable, so every wheel the
# build installs is staged on the host first (images/stage_wheels.py: PyPI's CUDA torch
# with its nvidia-* runtime wheels, which import on a CPU machine) and pip inside the build
# uses only those.
#
# Cached outside the checkout, so a warm run pays nothing: the wheels in
# ~/.cache/greenroom-k8s/wheels, the image in podman's store. The tag is a hash of what
# goes into the image (the tracked sources, uncommitted changes, the staged versions): an
# unchanged tree finds its image already built. The Dockerfile's deps stage (torch and
# every other wheel, GBs) is an image of its own, keyed on pyproject.toml, the Dockerfile
# and the staged wheels: a changed runtime/ builds one small layer on it (45 s here, 2 min
# 14 s when each build installed every wheel) and the cluster imports only that layer. Earlier `ci-` tags are removed (the image
# is GBs) unless a container uses them; other tags of localhost/greenroom (a user's `make
# image`) are left alone.
# Usage: images/ci-image.sh   (prints the image name on its last line)
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python

cache="${GREENROOM_K8S_CACHE:-$HOME/.cache/greenroom-k8s}"
wheels="$cache/wheels"
mkdir -p "$cache"
# One builder at a time: the cluster's start and a test run may ask at once.
exec 9>"$cache/.image.lock"
flock 9

"$python" images/stage_wheels.py "$wheels" >&2
sources=(runtime pyproject.toml README.md images scripts/build-image.sh)
# The files' contents as they are (committed or not: a commit alone does not rebuild),
# untracked files included, ignored ones (caches) and deleted ones left out.
files=$(git ls-files -co --exclude-standard --deduplicate -- "${sources[@]}" |
        while read -r file; do [ ! -f "$file" ] || echo "$file"; done | sort)
tag=$( (echo "$files"; echo "$files" | git hash-object --stdin-paths; cat "$wheels/.staged") |
       sha256sum | cut -c1-12)
prefix=localhost/greenroom:ci-
image=$prefix$tag
base=localhost/greenroom-ci-base:bookworm-2
# This machine's podman: vfs storage and chroot isolation (overlay and the default
# isolation fail on its cgroups); no intermediate layers (with vfs each is a full copy).
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot BUILDAH_LAYERS=false

# The Dockerfile's deps stage (torch and every wheel but greenroom's: the GBs) as an image
# of its own, keyed on what that stage reads: a changed runtime/ then builds and the
# cluster imports only the layer on top of it.
deps_prefix=localhost/greenroom-ci-deps:
deps=$deps_prefix$( (cat pyproject.toml images/Dockerfile scripts/build-image.sh "$wheels/.staged"; echo "$base") |
                    sha256sum | cut -c1-12)

if ! podman image exists "$image"; then
  bash images/ci-base.sh "$base" >&2
  # A CPU image: no nvcomp extra (its CUDA codec has nothing to run on here).
  export GREENROOM_BUILD_ENGINE=podman GREENROOM_IMAGE_WHEELS="$wheels" GREENROOM_PIP_NO_INDEX=1 \
    GREENROOM_IMAGE_EXTRAS=""
  podman image exists "$deps" || GREENROOM_BUILD_TARGET=deps scripts/build-image.sh "$deps" "$base" >&2
  GREENROOM_DEPS_IMAGE=$deps scripts/build-image.sh "$image" "$base" >&2
fi
# Never --force: that also removes the containers of the image, such as the test run of
# another checkout on this machine still using its own ci- tag; an image in use stays.
podman images --format '{{.Repository}}:{{.Tag}}' "${prefix%%:*}" |
  awk -v prefix="$prefix" -v keep="$image" 'index($0, prefix) == 1 && $0 != keep' |
  while read -r old; do
    podman rmi "$old" >/dev/null 2>&1 || echo "ci-image: left $old in place (a container uses it)" >&2
  done
# Then the deps images no ci- image is built on any more (podman refuses those still used).
podman images --format '{{.Repository}}:{{.Tag}}' "${deps_prefix%%:*}" |
  awk -v prefix="$deps_prefix" -v keep="$deps" 'index($0, prefix) == 1 && $0 != keep' |
  while read -r old; do podman rmi "$old" >/dev/null 2>&1 || true; done
echo "$image"
