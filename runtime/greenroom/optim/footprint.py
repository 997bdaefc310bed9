"""Bytes per parameter of what a training rank holds, by dtype: the one table that
``greenroom plan`` sizes runs with and the bucket store's layout is checked against
(tests/optim/test_exact.py). A change to what a param costs on disk or on the device
(a new moment dtype, masters kept elsewhere) is made here and plan follows.
"""

from __future__ import annotations

from greenroom.config import moment_bytes_per_element

PARAM_DTYPES = ("bf16", "fp16", "fp32")
PARAM_BYTES = {"bf16": 2.0, "fp16": 2.0, "fp32": 4.0}
# Gradients in the param's dtype (DDP's buckets and FSDP2's reduce-scatter keep it).
GRAD_BYTES = PARAM_BYTES
MASTER_BYTES = 4.0  # fp32 master of a 16-bit param
RESIDENT_MOMENT_BYTES = 4.0  # torch.optim.AdamW keeps fp32 moments for fp32 masters
# A master stored as a remainder (greenroom.optim.remainder): its low 16 bits, plus per
# bucket a fingerprint per 4096 elements and room for an exception per 1024.
REMAINDER_BYTES_PER_PARAM = 2.0 + 8 / 4096 + 12 / 1024


def has_master(param_dtype: str) -> bool:
    """A 16-bit param needs an fp32 master; an fp32 param is its own."""
    return PARAM_BYTES[param_dtype] < MASTER_BYTES


def streamed_bytes_per_param(moment_dtype: str, *, master_on_disk: bool = True, remainder: bool = False) -> float:
    """Bytes of streamed state per parameter: the fp32 master (unless the param is its
    own fp32 master; ``remainder``: its low 16 bits beside a bf16 param) plus the two
    Adam moments in ``moment_dtype``. Without ``remainder`` an upper bound for bf16
    params (Megatron's mains, and StreamingAdam with master_layout fp32, store the whole
    master)."""
    master = (REMAINDER_BYTES_PER_PARAM if remainder else MASTER_BYTES) if master_on_disk else 0.0
    return master + 2 * moment_bytes_per_element(moment_dtype)


def muon_bytes_per_param(moment_dtype: str, *, master_on_disk: bool = True) -> float:
    """Bytes of ``StreamingMuon``'s streamed state per parameter: the fp32 master (16-bit
    params) and one momentum buffer."""
    return (MASTER_BYTES if master_on_disk else 0.0) + moment_bytes_per_element(moment_dtype)


def resident_optimizer_bytes_per_param(param_dtype: str) -> float:
    """Mixed-precision AdamW's state on the device: fp32 master (16-bit params) and two
    fp32 moments."""
    return (MASTER_BYTES if has_master(param_dtype) else 0.0) + 2 * RESIDENT_MOMENT_BYTES


def streaming_device_bytes(bucket_numel: int, moment_dtype: str, *, buffers: int, master_on_disk: bool = True) -> float:
    """Device memory streaming holds during a step: ``buffers`` bucket buffers (one
    updating, one reading ahead, one still writing back: ``optim.store.layout.DEVICE_BUFFERS``,
    fewer where there are fewer buckets) and the fp32 grad scratch of one bucket."""
    return bucket_numel * (buffers * streamed_bytes_per_param(moment_dtype, master_on_disk=master_on_disk) + 4.0)
