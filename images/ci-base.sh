#!/usr/bin/env bash
# Makes the base image CI builds on: no registry is reachable there, so the base is a
# Debian bookworm made with debootstrap from the machine's Debian mirror, with Python.
# Usage: images/ci-base.sh [IMAGE]   (default localhost/greenroom-ci-base:bookworm-2)
# Idempotent: an image podman already has is kept, and the rootfs tarball is cached in
# .tools/ so a rerun imports it instead of bootstrapping again (~30 s -> ~5 s).
set -euo pipefail
cd "$(dirname "$0")/.."
image=${1:-localhost/greenroom-ci-base:bookworm-2}
cache=.tools/ci-base-bookworm-2.tar
# One maker at a time: the test cluster's start builds its images side by side.
mkdir -p .tools
exec 7>.tools/ci-base.lock
flock 7
if podman image exists "$image" 2>/dev/null; then
  echo "ci-base: $image already present"
  exit 0
fi
if [ ! -s "$cache" ]; then
  mirror=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/debian.sources 2>/dev/null || true)
  mirror=${mirror:-http://deb.debian.org/debian}
  rootfs=$(mktemp -d .tools/ci-base-rootfs.XXXXXX)
  # --one-file-system: a debootstrap cut short can leave the host's /proc or /sys mounted
  # in the rootfs; the removal must stop at them, not descend into the host's.
  trap 'rm -rf --one-file-system "$rootfs"' EXIT
  # The tarball's "./" carries this dir's mode into the image's /: mktemp's 0700 would leave
  # / closed to every user but root (the image's uid 1000 could not exec anything). The tag
  # is bookworm-2, so an image tagged bookworm that lacks this mode is never taken.
  chmod 0755 "$rootfs"
  echo "ci-base: debootstrap bookworm from $mirror"
  debootstrap --variant=minbase --include=python3,python3-pip,python3-venv,ca-certificates \
    bookworm "$rootfs" "$mirror" >/dev/null
  rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/*
  tar -C "$rootfs" -cf "$cache.tmp" .
  mv "$cache.tmp" "$cache"
fi
podman import "$cache" "$image" >/dev/null
echo "ci-base: imported $image"
