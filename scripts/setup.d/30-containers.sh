#!/usr/bin/env bash
# Installs podman, buildah, runc and debootstrap for the image test (tests/image/test_image.py;
# see scripts/lib/apt-install.sh for what happens when it cannot).
set -euo pipefail
# shellcheck source=scripts/lib/apt-install.sh
source "$(dirname "$0")/../lib/apt-install.sh"
apt_install 30-containers "the image test will skip" podman buildah runc debootstrap
