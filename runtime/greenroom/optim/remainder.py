"""The fp32 master of a bf16 param as the param plus a 16-bit remainder.

Note [remainder]: an fp32 master ``M`` and its bf16 param ``P = bf16(M)`` (round to
nearest, ties to even) share their high 16 bits up to the rounding direction: ``P`` is
``M``'s high half, or that plus one when the low half ``L`` rounded it up. Rounding up
happens exactly when ``L > 0x8000`` (or ``L == 0x8000`` with an odd high half, a tie), so
from ``P`` and ``L`` alone ``M = (P - (L > 0x8000)) << 16 | L`` for every master but the
ties that rounded up and the non-finite ones (a NaN casts to a canonical NaN, its
payload is gone). The store keeps only ``L`` (2 B/param instead of 4) and, per bucket, a
list of the elements that rule does not rebuild, found by rebuilding each element at
encode time and comparing its bits (so whatever the device's cast does, what is stored
decodes to the master's exact bits). A trained model's state has about 1.6e-5 ties;
half of them round up.

The rebuild needs the param the master was cast to. Anything else that writes the
param (``model.load_state_dict`` after the optimizer was built, ``p.data.copy_``, an EMA
swap) breaks that, so each ``FINGERPRINT_BLOCK`` elements of the bucket carry a
fingerprint of the cast taken when the bucket was encoded; at decode the params' block
is fingerprinted again, and a block whose fingerprint differs is re-seeded: every
element of it becomes the fp32 value of the param (what Note [masters follow the
params] does for the elements that changed; here the whole block, as which of its
elements changed is not recorded). A block whose params are unchanged keeps its
masters' exact bits.

The bucket's fixup segment: ``[fingerprints: int64 x blocks][count: int64][indices:
int64 x capacity][bits: int32 x capacity]``, the exceptions' element indices in the
bucket and their masters' bits. ``capacity`` is a thousandth of the elements (at least
64): some 60 times the ties a trained state has. A bucket with more exceptions (masters
gone non-finite in numbers) is refused in one line rather than stored wrong.
"""

from __future__ import annotations

import sys

import torch

from greenroom.errors import GreenroomError

FINGERPRINT_BLOCK = 4096
_PIECE = FINGERPRINT_BLOCK * 1024  # elements per piece: bounds the temporaries (~60 MB)
_ROUNDS_UP = 0x8000

assert sys.byteorder == "little", "the remainder layout reads an fp32's halves as two int16, low first"


def blocks(numel: int) -> int:
    return (numel + FINGERPRINT_BLOCK - 1) // FINGERPRINT_BLOCK


def capacity(numel: int) -> int:
    """Exceptions a bucket of ``numel`` elements can hold."""
    return max(64, numel // 1024)


def fixup_bytes(numel: int) -> int:
    return 8 * blocks(numel) + 8 + 12 * capacity(numel)


def _fixup_views(fixups: torch.Tensor, numel: int) -> tuple[torch.Tensor, ...]:
    """(fingerprints, count, indices, bits) views of a fixup segment (uint8)."""
    nb, cap = blocks(numel), capacity(numel)
    at = 8 * nb
    fingerprints = fixups[:at].view(torch.int64)
    count = fixups[at : at + 8].view(torch.int64)
    indices = fixups[at + 8 : at + 8 + 8 * cap].view(torch.int64)
    bits = fixups[at + 8 + 8 * cap : at + 8 + 12 * cap].view(torch.int32)
    return fingerprints, count, indices, bits


def _weights(device: torch.device) -> torch.Tensor:
    """A fixed odd int64 weight per position of a block: a fingerprint is the weighted
    sum of the block's 16-bit patterns, so any one changed element changes it.

    Made per call (4096 draws), never cached in a module global: a cached tensor made
    while an actor's memory is tracked belongs to that actor, and a sleep that released
    it (or a failed wake that gave it back) left the cache pointing at freed storage, a
    segfault in the next encode of the process."""
    gen = torch.Generator().manual_seed(0x5EED)
    return (torch.randint(0, 1 << 30, (FINGERPRINT_BLOCK,), generator=gen, dtype=torch.int64) * 2 + 1).to(device)


def _fingerprints(high: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per block of ``high`` (int32 holding unsigned 16-bit patterns) its fingerprint (int64),
    with the weights ``w`` (``_weights``)."""
    n = high.numel()
    full = n // FINGERPRINT_BLOCK * FINGERPRINT_BLOCK
    parts = []
    if full:
        parts.append((high[:full].view(-1, FINGERPRINT_BLOCK) * w).sum(dim=1))  # int32 * int64: int64
    if full < n:
        parts.append((high[full:] * w[: n - full]).sum().view(1))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _pieces(numel: int):
    for start in range(0, numel, _PIECE):
        yield start, min(numel, start + _PIECE)


class _Work:
    """Piece-sized work tensors, made once per call and reused by every piece: a bucket
    of 2e8 elements is 48 pieces, and fresh temporaries per piece (a dozen of 16-32 MB)
    left the host allocator holding a few hundred MB of freed pieces on a CPU device."""

    def __init__(self, numel: int, device: torch.device) -> None:
        n = min(numel, _PIECE)
        self.lo, self.high, self.rebuilt = (torch.empty(n, dtype=torch.int32, device=device) for _ in range(3))
        self.flag = torch.empty(n, dtype=torch.bool, device=device)
        self.cast = torch.empty(n, dtype=torch.bfloat16, device=device)
        self.weights = _weights(device)

    def halves(self, bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The low halves of ``bits`` (int32) and room for the high ones, both as int32."""
        n = bits.numel()
        lo = self.lo[:n]
        torch.bitwise_and(bits, 0xFFFF, out=lo)
        return lo, self.high[:n]

    def rebuild(self, high: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
        """``(high - (lo > 0x8000)) << 16 | lo``: the master the rule rebuilds."""
        rebuilt = self.rebuilt[: lo.numel()]
        torch.gt(lo, _ROUNDS_UP, out=rebuilt)  # 1 where the low half rounded the param up
        torch.sub(high, rebuilt, out=rebuilt)
        rebuilt.bitwise_left_shift_(16).bitwise_or_(lo)
        return rebuilt


def encode(master: torch.Tensor, low: torch.Tensor, fixups: torch.Tensor, *, label: str) -> int:
    """Store flat fp32 ``master`` as its low halves into ``low`` (int16, same numel) and
    its fingerprints and exceptions into the uint8 segment ``fixups``; returns how many
    exceptions it stored (Note [remainder])."""
    numel = master.numel()
    fingerprints, count, indices, bits_out = _fixup_views(fixups, numel)
    halves = master.view(torch.int16).view(-1, 2)
    low.copy_(halves[:, 0])
    work = _Work(numel, master.device)
    found_at, found_bits = [], []
    for start, stop in _pieces(numel):
        bits = master[start:stop].view(torch.int32)
        lo, high = work.halves(bits)
        cast = work.cast[: stop - start]
        cast.copy_(master[start:stop])  # the bf16 param this master casts to
        high.copy_(cast.view(torch.int16)).bitwise_and_(0xFFFF)  # its pattern, sign-extended, then unsigned
        fingerprints[start // FINGERPRINT_BLOCK : blocks(stop)].copy_(_fingerprints(high, work.weights))
        wrong = torch.ne(work.rebuild(high, lo), bits, out=work.flag[: stop - start]).nonzero().view(-1)
        if wrong.numel():
            found_at.append(wrong + start)
            found_bits.append(bits[wrong])
    n = sum(t.numel() for t in found_at)
    if n > indices.numel():
        raise GreenroomError(
            f"{label}: {n} fp32 masters are not the bf16 param plus a 16-bit remainder (ties that "
            f"rounded up, or non-finite masters), more than the {indices.numel()} the bucket "
            "holds: the masters have gone non-finite; build the optimizer with "
            "master_layout='fp32' to store them whole"
        )
    count.fill_(n)
    if n:
        indices[:n].copy_(torch.cat(found_at))
        bits_out[:n].copy_(torch.cat(found_bits))
    return n


def decode(
    master: torch.Tensor, low: torch.Tensor, fixups: torch.Tensor, params: list[tuple[int, torch.Tensor]]
) -> torch.Tensor:
    """Rebuild flat fp32 ``master`` from the bf16 ``params`` (``(first element, tensor)``
    of each, covering the bucket in order), the low halves ``low`` and the segment
    ``fixups``; blocks whose params changed since the encode are re-seeded from the
    params. Returns the number of re-seeded blocks (a device int64 scalar)."""
    numel = master.numel()
    fingerprints, count, indices, bits_in = _fixup_views(fixups, numel)
    halves = master.view(torch.int16).view(-1, 2)
    halves[:, 0].copy_(low)
    for start, p in params:
        halves[start : start + p.numel(), 1].copy_(p.detach().reshape(-1).view(torch.int16))
    changed = torch.empty(blocks(numel), dtype=torch.bool, device=master.device)
    work = _Work(numel, master.device)
    for start, stop in _pieces(numel):
        bits = master[start:stop].view(torch.int32)
        lo, high = work.halves(bits)
        torch.bitwise_right_shift(bits, 16, out=high).bitwise_and_(0xFFFF)
        first, last = start // FINGERPRINT_BLOCK, blocks(stop)
        piece_changed = changed[first:last]
        torch.ne(_fingerprints(high, work.weights), fingerprints[first:last], out=piece_changed)
        reseed = piece_changed.repeat_interleave(FINGERPRINT_BLOCK)[: stop - start]
        rebuilt = work.rebuild(high, lo)
        param_value = torch.bitwise_and(bits, ~0xFFFF, out=lo)  # the param's value: its high half, low half 0
        torch.where(reseed, param_value, rebuilt, out=bits)
    n = int(count.item())
    if not 0 <= n <= indices.numel():
        raise GreenroomError(
            f"the fixup list of a bucket records {n} exceptions, more than its {indices.numel()}: "
            "the state is damaged; restart from the last checkpoint"
        )
    if n:
        at = indices[:n]
        keep = ~changed[at // FINGERPRINT_BLOCK]
        master.view(torch.int32)[at[keep]] = bits_in[:n][keep]
    return changed.sum()


__all__ = ["FINGERPRINT_BLOCK", "blocks", "capacity", "decode", "encode", "fixup_bytes"]
