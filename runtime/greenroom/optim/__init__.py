"""Optimizer-state streaming: AdamW whose fp32 masters and moments live in per-bucket files.

- ``store``: the bucket store/engine (layout, bounded init, streamed read-ahead and
  write-behind through ``greenroom.io.engine``); shared with ``greenroom.megatron``.
- ``codecs``: moment storage dtypes (fp32, bf16, fp16, fp8 with per-block scales).
- ``kernel``: one bucket's update with torch's own AdamW functional.
- ``adam``: ``StreamingAdam``, the ``torch.optim.Optimizer``.
- ``muon``: ``StreamingMuon``, ``torch.optim.Muon`` with its momentum streamed the same way
  (``muon_state``: its state dict in torch's format).
- ``instep``: the checkpoint a step writes from its own streaming pass.
- ``poison``: a failed step refuses every later step and save until a load (all three optimizers).
- ``hardlink``: hard links between the live bucket files and a checkpoint's.
- ``reflink``: extent clones of the bucket files where links are refused and the filesystem can clone.
- ``checkpoint``: ``save_checkpoint`` / ``load_checkpoint`` with the manifest and its refusals
  (``filecopy``: the bytes copied and checked where neither links nor clones work).
- ``state_dict``: ``StreamingAdam.state_dict()`` / ``load_state_dict()`` in torch's format,
  views of the bucket files (trainers, ``torch.distributed.checkpoint``).
- ``lightning``: ``StreamingCheckpointIO``, Lightning checkpoint I/O without a host copy
  (imports Lightning; not imported here).
"""

from greenroom.optim.adam import RESIDENT_NUMEL, StreamingAdam
from greenroom.optim.muon import StreamingMuon
from greenroom.optim.store.bucket_store import DEFAULT_BUCKET_NUMEL, Bucket, BucketState, BucketStore, Entry

__all__ = [
    "Bucket",
    "BucketState",
    "BucketStore",
    "DEFAULT_BUCKET_NUMEL",
    "Entry",
    "RESIDENT_NUMEL",
    "StreamingAdam",
    "StreamingMuon",
]
