#!/usr/bin/env bash
# Builds the CPU greenroom image the test cluster's pods run (scripts/k8s/Containerfile, on
# the debootstrap base of images/ci-base.sh) and imports it into the cluster's containerd.
# No registry is reachable and PyPI's torch is the CUDA build, so the wheels are staged by
# scripts/k8s/stage_wheels.py (torch without its CUDA libraries). The tag is a hash of what
# goes into the image: an unchanged tree reuses the image podman and containerd already hold.
# Usage: scripts/k8s/image.sh CONTAINERD_SOCKET   (prints the image name on its last line)
set -euo pipefail
[ "$#" -eq 1 ] || { echo "usage: scripts/k8s/image.sh CONTAINERD_SOCKET" >&2; exit 2; }
socket=$1
cd "$(dirname "$0")/../.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] && python=.venv/bin/python

tag=$( (git ls-files -s runtime pyproject.toml README.md images scripts/k8s/Containerfile scripts/k8s/stage_wheels.py;
        git diff HEAD -- runtime pyproject.toml images) | sha256sum | cut -c1-12)
image=localhost/greenroom:k8s-$tag
base=localhost/greenroom-ci-base:bookworm
wheels="${GREENROOM_K8S_CACHE:-$HOME/.cache/greenroom-k8s}/wheels"
export STORAGE_DRIVER=vfs BUILDAH_ISOLATION=chroot
ctr=(ctr --address "$socket" --namespace k8s.io)

if ! "${ctr[@]}" images ls -q "name==$image" | grep -q .; then
  if ! podman image exists "$image"; then
    bash images/ci-base.sh "$base" >&2
    mkdir -p "$wheels"
    "$python" scripts/k8s/stage_wheels.py "$wheels" >&2
    context=$(mktemp -d "${TMPDIR:-/tmp}/greenroom-k8s-image.XXXXXX")
    cp pyproject.toml README.md "$context/"
    tar -c --exclude=__pycache__ --exclude='*.egg-info' runtime | tar -x -C "$context"
    mkdir "$context/wheels"
    cp -l "$wheels"/*.whl "$context/wheels/" 2>/dev/null || cp "$wheels"/*.whl "$context/wheels/"
    podman build -q --build-arg "BASE_IMAGE=$base" -t "$image" -f scripts/k8s/Containerfile "$context" >&2
    rm -rf "$context"
  fi
  archive=$(mktemp "${TMPDIR:-/tmp}/greenroom-image.XXXXXX")
  trap 'rm -f "$archive"' EXIT
  podman save -q --format docker-archive -o "$archive" "$image"
  "${ctr[@]}" images import "$archive" >/dev/null
fi
echo "$image"
