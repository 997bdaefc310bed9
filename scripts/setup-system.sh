#!/usr/bin/env bash
# Installs the system tools the test suite uses. Each component has its own
# scripts/setup-*.d step; a step that cannot run (no root, not Debian) prints why
# and the tests that need it skip with that reason.
set -euo pipefail
cd "$(dirname "$0")/.."
for step in scripts/setup.d/*.sh; do
  [ -e "$step" ] || continue
  echo "== $step"
  bash "$step"
done
