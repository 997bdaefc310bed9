"""The fp32 state a ``BucketStore`` hands out of a device buffer's bytes, and its way back.

``StateViews`` turns a bucket's bytes in a device buffer into the ``BucketState`` a stream
yields (the master viewed in place or rebuilt from its remainder and the params,
``greenroom.optim.remainder`` Note [remainder]; each moment viewed in place, or decoded
from its narrow dtype into an fp32 scratch tensor), and the updated state back into the
bytes. It owns the scratch tensors: one fp32 tensor of the largest bucket per kind it
needs (master, exp_avg, exp_avg_sq), made on first use.
"""

from __future__ import annotations

from typing import Callable

import torch

from greenroom.optim import remainder
from greenroom.optim.store.layout import Bucket, BucketState, Entry


class StateViews:
    """The decoding and encoding of a ``BucketStore``'s buckets, which owns one. ``entries``
    and ``buckets`` are the store's own lists (what it adds is this object's too);
    ``params`` as the store takes it; ``codecs`` the moments' (``optim.moments.moment_codecs``);
    ``path`` names a bucket's live file, for an error."""

    def __init__(
        self,
        entries: list[Entry],
        buckets: list[Bucket],
        params: Callable[[int], torch.Tensor] | None,
        codecs: tuple,
        device: torch.device,
        path: Callable[[int], str],
    ) -> None:
        self.entries = entries
        self.buckets = buckets
        self.params = params
        self.avg_codec, self.sq_codec = codecs
        self.device = device
        self.path = path
        self.reseeded_blocks = 0  # fingerprint blocks re-seeded from changed params (a device tensor once any ran)
        self._scratch: dict[str, torch.Tensor] = {}

    def fill_masters(self, bucket: Bucket, raw: torch.Tensor, get: Callable[[int], torch.Tensor]) -> None:
        """Set bucket ``bucket``'s masters in ``raw`` from ``get`` (entry index -> a tensor
        of the entry's shape, any dtype and device)."""
        if bucket.master is None:
            return
        master = self._scratch_tensor("master")[: bucket.numel] if bucket.remainder else _master_view(raw, bucket)
        for i, start in zip(bucket.entries, bucket.offsets):
            n = self.entries[i].numel
            master[start : start + n].copy_(get(i).detach().reshape(-1))
        if bucket.remainder:
            self._encode_remainder(bucket, master, raw)

    def decode(self, index: int, raw: torch.Tensor) -> BucketState:
        """Bucket ``index``'s state as fp32 tensors, out of its bytes ``raw``."""
        bucket = self.buckets[index]
        if bucket.remainder:
            master = self._scratch_tensor("master")[: bucket.numel]
            params = [(start, self.params(i)) for i, start in zip(bucket.entries, bucket.offsets)]
            reseeded = remainder.decode(master, _low_view(raw, bucket), _fixups_view(raw, bucket), params)
            self.reseeded_blocks = reseeded + self.reseeded_blocks
        else:
            master = _master_view(raw, bucket) if bucket.master is not None else None
        moments = []
        for codec, seg, key in (
            (self.avg_codec, bucket.exp_avg, "exp_avg"),
            (self.sq_codec, bucket.exp_avg_sq, "exp_avg_sq"),
        ):
            if seg is None:
                moments.append(None)
                continue
            seg_raw = raw[seg.offset : seg.offset + seg.nbytes]
            if codec.identity:
                moments.append(codec.view(seg_raw, bucket.numel))
            else:
                work = self._scratch_tensor(key)[: bucket.numel]
                codec.decode(seg_raw, work)
                moments.append(work)
        shapes = [self.entries[i].shape for i in bucket.entries]
        return BucketState(bucket=bucket, master=master, exp_avg=moments[0], exp_avg_sq=moments[1], _shapes=shapes)

    def encode(self, state: BucketState, raw: torch.Tensor) -> None:
        """Put ``state`` (as ``decode`` gave it, updated) back into its bucket's bytes ``raw``."""
        bucket = state.bucket
        if bucket.remainder:
            self._encode_remainder(bucket, state.master, raw)
        for codec, seg, work in (
            (self.avg_codec, bucket.exp_avg, state.exp_avg),
            (self.sq_codec, bucket.exp_avg_sq, state.exp_avg_sq),
        ):
            if seg is not None and not codec.identity:
                codec.encode(work, raw[seg.offset : seg.offset + seg.nbytes])

    def _encode_remainder(self, bucket: Bucket, master: torch.Tensor, raw: torch.Tensor) -> None:
        remainder.encode(
            master,
            _low_view(raw, bucket),
            _fixups_view(raw, bucket),
            label=f"{self.path(bucket.index)}: bucket {bucket.index} of the optimizer state",
        )

    def _scratch_tensor(self, key: str) -> torch.Tensor:
        if key not in self._scratch:
            numel = max(b.numel for b in self.buckets)
            self._scratch[key] = torch.empty(numel, dtype=torch.float32, device=self.device)
        return self._scratch[key]

    @property
    def scratch_bytes(self) -> int:
        """Device memory the scratch tensors take."""
        return sum(t.numel() * 4 for t in self._scratch.values())

    def release(self) -> None:
        """Give the scratch tensors back (made again when next needed)."""
        self._scratch.clear()


def _low_view(raw: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    return raw[bucket.master.offset : bucket.master.offset + bucket.master.nbytes].view(torch.int16)


def _fixups_view(raw: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    return raw[bucket.fixups.offset : bucket.fixups.offset + bucket.fixups.nbytes]


def _master_view(raw: torch.Tensor, bucket: Bucket) -> torch.Tensor:
    return raw[bucket.master.offset : bucket.master.offset + bucket.master.nbytes].view(torch.float32)
