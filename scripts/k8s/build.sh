#!/usr/bin/env bash
# Builds the Kubernetes test cluster's programs from their Go modules into a cache outside
# the checkout. Each wrapper module under scripts/k8s/ (go.mod, go.sum committed; a main.go
# where upstream's main links more than the cluster needs) builds into
#   ~/.cache/greenroom-k8s/<kubernetes release>/<module>-<hash of its go.mod, go.sum, *.go>/
# so only a new machine, or a changed module, pays its build. The programs are then linked
# into one directory, whose path is the last line printed:
#   ~/.cache/greenroom-k8s/<kubernetes release>/bin-<hash of every module>/
# Usage: scripts/k8s/build.sh
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
command -v go >/dev/null || {
  echo "build.sh: go not found on PATH: install Go >= 1.26 to build the Kubernetes test cluster" >&2
  exit 3
}

RELEASE="$(grep -Eo 'k8s.io/kubernetes v[0-9.]+' "$HERE/kubernetes/go.mod" | head -1 | cut -d' ' -f2)"
ROOT="${GREENROOM_K8S_CACHE:-$HOME/.cache/greenroom-k8s}/$RELEASE"
mkdir -p "$ROOT"
# One builder at a time: a second `make test` waits for the first one's build.
exec 9>"$ROOT/.build.lock"
flock 9

# -trimpath and no symbol tables: the same binaries on every machine, and smaller.
export GOFLAGS="-trimpath -buildvcs=false"

# The key of a module's build: its files and the link flags it is built with.
module_key() {
  (cd "$HERE/$1" && shopt -s nullglob && { cat go.mod ./go.su[m] ./*.go; [ -z "$LDFLAGS" ] || echo "$LDFLAGS"; } |
    sha256sum | cut -c1-12)
}

links=()
# build MODULE_DIR NAME=PACKAGE...: one `go build` for a module's programs, so they share
# the compile of their common packages. LDFLAGS: the link flags (without symbol tables).
build() {
  local dir=$1; shift
  local out pkgs=() spec
  out="$ROOT/$dir-$(module_key "$dir")"
  for spec in "$@"; do
    [[ -x "$out/${spec%%=*}" ]] || pkgs+=("${spec#*=}")
    links+=("$out/${spec%%=*}")
  done
  ((${#pkgs[@]})) || return 0
  echo "build.sh: building ${pkgs[*]} in scripts/k8s/$dir (a cold build of them all: tens of minutes on 2 cores)" >&2
  local tmp
  tmp="$(mktemp -d "$ROOT/.tmp.XXXXXX")"
  (cd "$HERE/$dir" && go build -ldflags="-s -w $LDFLAGS" -o "$tmp/" "${pkgs[@]}")
  mkdir -p "$out"
  for spec in "$@"; do
    local built
    built="$tmp/$(basename "${spec#*=}")"
    [[ "${spec#*=}" == . ]] && built="$tmp/$(basename "$(go -C "$HERE/$dir" list -f '{{.Target}}' .)")"
    [[ -e "$built" ]] && mv "$built" "$out/${spec%%=*}"
  done
  rm -rf "$tmp"
}

# The release the components report (`kubectl version`, the discovery helm checks a chart's
# kubeVersion against); a build from the module would otherwise say v0.0.0-master.
minor=$(echo "$RELEASE" | cut -d. -f2)
version_flags=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  version_flags+=" -X $pkg.gitVersion=$RELEASE -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor -X $pkg.gitTreeState=clean"
done
LDFLAGS="$version_flags" build kubernetes \
  kube-apiserver=k8s.io/kubernetes/cmd/kube-apiserver \
  kube-controller-manager=k8s.io/kubernetes/cmd/kube-controller-manager \
  kube-scheduler=k8s.io/kubernetes/cmd/kube-scheduler \
  kubelet=k8s.io/kubernetes/cmd/kubelet \
  kube-proxy=k8s.io/kubernetes/cmd/kube-proxy
LDFLAGS="" build jobset jobset=sigs.k8s.io/jobset
LDFLAGS="" build coredns coredns=.
# The pause program runs alone in an image: static.
LDFLAGS="" CGO_ENABLED=0 build pause pause=.

# The key also names what is copied from the JobSet module: a change there makes a new dir.
jobset_config=(components default)
all="$(printf '%s\n' "${links[@]}" "${jobset_config[@]}" | sha256sum | cut -c1-12)"
BIN="$ROOT/bin-$all"
if [[ ! -d "$BIN" ]]; then
  mkdir -p "$BIN.tmp"
  ln -sf "${links[@]}" "$BIN.tmp/"
  # Upstream's deployment of the JobSet controller (config/default and the components it
  # builds on), from the same module release as the controller.
  module_config="$(go -C "$HERE/jobset" list -m -f '{{.Dir}}' sigs.k8s.io/jobset)/config"
  mkdir "$BIN.tmp/jobset-config"
  for part in "${jobset_config[@]}"; do cp -r "$module_config/$part" "$BIN.tmp/jobset-config/"; done
  chmod -R u+w "$BIN.tmp/jobset-config"
  mv "$BIN.tmp" "$BIN"
fi
echo "$BIN"
