#!/usr/bin/env bash
# Fills .whl/ with what the GPU machine lacks for greenroom's GPU tests and benches. That
# machine has Python 3.12 with torch and no package index, so these travel as files: name
# .whl in the device call's carry, and start its command with `. scripts/gpu/env.sh`.
#   .whl/*.whl  torch_memory_saver, zstandard, nvCOMP (both wheels: the second holds
#               libnvcomp.so.6; with only the first, `auto` falls back to none there),
#               megatron-core (cp312)
#   .whl/ds/    DeepSpeed's sdist, the wheels it needs, and Debian's libaio .debs: the
#               peer of `bench stream --against deepspeed` (with --deepspeed only)
# Downloads are cached outside the checkout, so a fresh clone pays them once per machine.
# Versions are those the figures in docs/benchmarks.md were measured with.
set -euo pipefail
usage() { echo "usage: $0 [--deepspeed]" >&2; exit 2; }
deepspeed=0
for arg in "$@"; do
  case $arg in
    --deepspeed) deepspeed=1 ;;
    *) usage ;;
  esac
done
cd "$(dirname "$0")/../.."
cache=${GREENROOM_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/greenroom}/gpu-carry
python=${PYTHON:-python3}
# The device machine's interpreter, not this one's: pip must pick cp312 manylinux builds.
target=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64 --platform any)
wheels=(torch-memory-saver==0.0.10 zstandard==0.25.0 nvidia-nvcomp-cu13==6.0.0.12
        nvidia-libnvcomp-cu13==6.0.0.12 megatron-core==0.19.2)
ds_wheels=(hjson==3.1.0 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
           typing-inspection==0.4.5 typing-extensions==4.16.0)

mkdir -p "$cache/ds"
"$python" -m pip download -q "${target[@]}" -d "$cache" "${wheels[@]}"
if [ "$deepspeed" = 1 ]; then
  "$python" -m pip download -q "${target[@]}" -d "$cache/ds" "${ds_wheels[@]}"
  "$python" -m pip download -q --no-deps --no-binary=:all: -d "$cache/ds" deepspeed==0.19.8
  if ! compgen -G "$cache/ds/libaio-dev_*.deb" >/dev/null; then
    (cd "$cache/ds" && apt-get download libaio1 libaio-dev 2>/dev/null)
  fi
fi

# env.sh installs every wheel in .whl (two versions of one package stop that install), so
# the wheels, sdist and .debs here are replaced; other files (a call's scripts) are kept.
# Links, not copies, where the cache shares the filesystem. A device call carries at most
# 64 MiB.
mkdir -p .whl
rm -f .whl/*.whl .whl/ds/*.whl .whl/ds/*.deb .whl/ds/deepspeed-*.tar.gz
for spec in "${wheels[@]}"; do
  name=${spec%%==*}; version=${spec##*==}
  cp -l "$cache/${name//-/_}-$version-"*.whl .whl/ 2>/dev/null || cp "$cache/${name//-/_}-$version-"*.whl .whl/
done
if [ "$deepspeed" = 1 ]; then
  mkdir -p .whl/ds
  for spec in "${ds_wheels[@]}"; do
    name=${spec%%==*}; version=${spec##*==}
    cp -l "$cache/ds/${name//-/_}-$version-"*.whl .whl/ds/ 2>/dev/null || cp "$cache/ds/${name//-/_}-$version-"*.whl .whl/ds/
  done
  cp "$cache/ds/deepspeed-0.19.8.tar.gz" "$cache/ds/"libaio*.deb .whl/ds/
fi
echo "carry.sh: .whl holds $(du -sh .whl | cut -f1) (a device call carries at most 64 MiB)"
