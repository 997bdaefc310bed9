#!/usr/bin/env bash
# strace, for the fault-injection tests that make a syscall fail or SIGKILL the trainer
# at it (`strace -e inject=`, tests/test_train_faults.py).
set -euo pipefail
# shellcheck source=scripts/lib/apt-install.sh
source "$(dirname "$0")/../lib/apt-install.sh"
apt_install 40-strace "the strace fault-injection tests will skip" strace
