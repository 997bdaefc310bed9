#!/usr/bin/env bash
# Installs podman, buildah, runc and debootstrap for the image test (tests/test_image.py).
# Idempotent; when it cannot run (not root, no apt) it says why and exits 0 so the image
# test skips with that reason instead of failing the suite.
set -euo pipefail
packages=(podman buildah runc debootstrap)
if [ "$(id -u)" -ne 0 ]; then
  echo "30-containers: not root, not installing ${packages[*]} (the image test will skip)"
  exit 0
fi
if ! command -v apt-get >/dev/null || [ ! -r /etc/debian_version ]; then
  echo "30-containers: not a Debian system with apt-get, not installing ${packages[*]} (the image test will skip)"
  exit 0
fi
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -eq 0 ]; then
  echo "30-containers: ${packages[*]} already installed"
  exit 0
fi
echo "30-containers: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq || { echo "30-containers: apt-get update failed (the image test will skip)"; exit 0; }
apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
  || { echo "30-containers: apt-get install failed (the image test will skip)"; exit 0; }
echo "30-containers: installed"
