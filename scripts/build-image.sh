#!/usr/bin/env bash
# Builds the greenroom image: `make image` runs `scripts/build-image.sh IMAGE:TAG BASE_IMAGE`.
# Engine: docker when its daemon answers, otherwise podman, otherwise buildah
# (GREENROOM_BUILD_ENGINE=docker|podman|buildah picks one). podman and buildah honour
# STORAGE_DRIVER and BUILDAH_ISOLATION from the environment (CI: vfs and chroot).
#
# Optional environment:
#   GREENROOM_IMAGE_WHEELS  a dir of wheels staged into the build (CI: the CPU torch wheel
#                           and every dependency), e.g. for a base without torch
#   GREENROOM_PIP_NO_INDEX  1: pip installs from those wheels only
#   GREENROOM_IMAGE_EXTRAS  greenroom's extras to install (default nvcomp, the GPU codec;
#                           empty for a CPU image)
#   GREENROOM_BUILD_CA      a CA bundle to mount for pip (podman/buildah only), for a
#                           package mirror the base image's CAs do not know
#   GREENROOM_BUILD_TARGET  deps: build only the Dockerfile's deps stage (what greenroom
#                           needs, without greenroom)
#   GREENROOM_DEPS_IMAGE    an image that stage built earlier, from the same pyproject.toml
#                           and wheels: the build starts from it (images/ci-image.sh)
set -euo pipefail
usage="usage: scripts/build-image.sh IMAGE:TAG BASE_IMAGE"
[ "$#" -eq 2 ] || { echo "$usage" >&2; exit 2; }
image=$1
base=$2
cd "$(dirname "$0")/.."

engine=${GREENROOM_BUILD_ENGINE:-}
if [ -z "$engine" ]; then
  if command -v docker >/dev/null && docker info >/dev/null 2>&1; then engine=docker
  elif command -v podman >/dev/null; then engine=podman
  elif command -v buildah >/dev/null; then engine=buildah
  else
    echo "build-image: no docker daemon answers and neither podman nor buildah is installed" \
         "(scripts/setup.d/30-containers.sh installs them on Debian)" >&2
    exit 2
  fi
fi

context=$(mktemp -d "${TMPDIR:-/tmp}/greenroom-image.XXXXXX")
trap 'rm -rf "$context"' EXIT
# Only what the install needs: a small context, and no .venv/.tools/.run leaking in.
cp images/Dockerfile pyproject.toml README.md "$context/"
tar -c --exclude=__pycache__ --exclude='*.egg-info' runtime | tar -x -C "$context"
mkdir "$context/wheels"
if [ -n "${GREENROOM_IMAGE_WHEELS:-}" ]; then
  [ -d "$GREENROOM_IMAGE_WHEELS" ] || { echo "build-image: GREENROOM_IMAGE_WHEELS=$GREENROOM_IMAGE_WHEELS is not a directory" >&2; exit 2; }
  # Without one, the glob stays as written and cp fails on a file named '*.whl'.
  compgen -G "$GREENROOM_IMAGE_WHEELS/*.whl" >/dev/null \
    || { echo "build-image: GREENROOM_IMAGE_WHEELS=$GREENROOM_IMAGE_WHEELS holds no wheel (*.whl)" >&2; exit 2; }
  cp -l "$GREENROOM_IMAGE_WHEELS"/*.whl "$context/wheels/" 2>/dev/null \
    || cp "$GREENROOM_IMAGE_WHEELS"/*.whl "$context/wheels/"
fi

version=$(python3 -c "import tomllib;print(tomllib.load(open('pyproject.toml','rb'))['project']['version'])" 2>/dev/null || echo dev)
revision=$(git rev-parse HEAD 2>/dev/null || echo unknown)
args=(--build-arg "BASE_IMAGE=$base" --build-arg "VERSION=$version" --build-arg "REVISION=$revision"
      --build-arg "CREATED=$(date -u +%Y-%m-%dT%H:%M:%SZ)" --build-arg "PIP_NO_INDEX=${GREENROOM_PIP_NO_INDEX:-0}"
      --build-arg "GREENROOM_EXTRAS=${GREENROOM_IMAGE_EXTRAS-nvcomp}"
      -t "$image" -f "$context/Dockerfile")
[ -z "${GREENROOM_BUILD_TARGET:-}" ] || args+=(--target "$GREENROOM_BUILD_TARGET")
[ -z "${GREENROOM_DEPS_IMAGE:-}" ] || args+=(--build-arg "DEPS_IMAGE=$GREENROOM_DEPS_IMAGE")
if [ -n "${GREENROOM_BUILD_CA:-}" ]; then
  [ "$engine" != docker ] || { echo "build-image: GREENROOM_BUILD_CA needs podman or buildah (docker build has no -v)" >&2; exit 2; }
  args+=(-v "$GREENROOM_BUILD_CA:/run/host-ca.crt:ro" --build-arg PIP_CERT=/run/host-ca.crt)
fi

echo "build-image: $engine building $image on $base"
case "$engine" in
  docker) docker build "${args[@]}" "$context" ;;
  podman) podman build "${args[@]}" "$context" ;;
  buildah) buildah bud "${args[@]}" "$context" ;;
  *) echo "build-image: GREENROOM_BUILD_ENGINE=$engine is not docker, podman or buildah" >&2; exit 2 ;;
esac
echo "build-image: built $image"
