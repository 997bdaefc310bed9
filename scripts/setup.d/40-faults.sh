#!/usr/bin/env bash
# Installs what the fault-injection suite (tests/faults/test_faults.py) drives: mkfs.ext4 and
# filefrag (e2fsprogs), losetup and mount (util-linux, mount), dmsetup and blockdev, and
# strace for the trainer's syscall-injected kills (tests/train/test_faults.py), and mkfs.xfs
# (xfsprogs) for the reflink checkpoints on a loop-mounted XFS (tests/optim/test_reflink.py); see
# scripts/lib/apt-install.sh for what happens when it cannot.
set -euo pipefail
# shellcheck source=scripts/lib/apt-install.sh
source "$(dirname "$0")/../lib/apt-install.sh"
apt_install 40-faults "the fault-injection tests will skip" e2fsprogs util-linux mount dmsetup strace xfsprogs
