# shellcheck shell=bash
# Sourced at the start of a device call's command, from the repo root, with .whl carried
# (scripts/gpu/carry.sh made it):  . scripts/gpu/env.sh [deepspeed] || exit
# Installs the carried wheels beside the machine's own torch (under /tmp, never into its
# environment) and exports what greenroom's GPU tests and benches need.
GREENROOM_GPU_SITE=/tmp/site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target "$GREENROOM_GPU_SITE" .whl/*.whl || return 1
export PYTHONPATH="$GREENROOM_GPU_SITE:$PWD/runtime"
# That machine's NVLink multicast must stay off (the device tool's KINDS.md says why).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
if [ "${1:-}" = deepspeed ]; then
  # DeepSpeed builds its async_io op against libaio at first use; its builder cannot parse
  # Hopper's "9.0a", hence the plain arch list.
  for deb in .whl/ds/libaio*.deb; do dpkg -x "$deb" /tmp/aio || return 1; done
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$GREENROOM_GPU_SITE" .whl/ds/*.whl || return 1
  python3 -m pip install -q --no-deps --no-build-isolation --no-cache-dir --target /tmp/ds \
    .whl/ds/deepspeed-0.19.8.tar.gz || return 1
  export PYTHONPATH="$PYTHONPATH:/tmp/ds" TORCH_CUDA_ARCH_LIST=9.0 CPATH=/tmp/aio/usr/include
  aio_lib=/tmp/aio/usr/lib/x86_64-linux-gnu
  export LIBRARY_PATH="$aio_lib${LIBRARY_PATH:+:$LIBRARY_PATH}" LD_LIBRARY_PATH="$aio_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
