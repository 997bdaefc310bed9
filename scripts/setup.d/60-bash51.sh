#!/usr/bin/env bash
# Puts Debian 11's bash 5.1 in .tools/bash-5.1/bin/bash, beside the machine's own bash, so the
# Slurm templates' quoting is tested under both (tests/slurm/test_render.py): a cluster's
# nodes run the batch script with their own /bin/bash, and Debian 11, Ubuntu 22.04 and
# RHEL 9 ship 5.1. Only the binary is unpacked (dpkg-deb -x), nothing is installed; the
# .deb is checked against its pinned SHA-256. Idempotent; on failure it says why and exits
# 0, and those tests skip with a reason. (No bash 4.x package is reachable from here:
# Debian's archive of older releases is not served.)
set -euo pipefail
cd "$(dirname "$0")/../.."
deb=bash_5.1-2+deb11u1_amd64.deb
sha256=f702ef058e762d7208a9c83f6f6bbf02645533bfd615c54e8cdcce842cd57377
dest=.tools/bash-5.1
if [ -x "$dest/bin/bash" ] && "$dest/bin/bash" -c 'echo "$BASH_VERSION"' | grep -q '^5\.1\.'; then
  echo "60-bash51: $("$dest/bin/bash" -c 'echo "$BASH_VERSION"') already in $dest"
  exit 0
fi
if [ "$(uname -m)" != x86_64 ] || ! command -v dpkg-deb >/dev/null; then
  echo "60-bash51: needs x86_64 and dpkg-deb (the bash 5.1 quoting tests will skip)"
  exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! curl -fsS --max-time 120 -o "$work/$deb" "http://deb.debian.org/debian/pool/main/b/bash/$deb"; then
  echo "60-bash51: could not download $deb from deb.debian.org (the bash 5.1 quoting tests will skip)"
  exit 0
fi
if ! echo "$sha256  $work/$deb" | sha256sum -c --quiet -; then
  echo "60-bash51: $deb does not match its SHA-256 (the bash 5.1 quoting tests will skip)"
  exit 0
fi
dpkg-deb -x "$work/$deb" "$work/root"
mkdir -p "$dest/bin"
install -m 0755 "$work/root/bin/bash" "$dest/bin/bash"
echo "60-bash51: installed $("$dest/bin/bash" -c 'echo "$BASH_VERSION"') in $dest"
