"""Checksums of every byte the I/O engine moves (``greenroom.io.engine``).

Note [integrity]: a disk that flips a bit, a firmware bug or a stray write must never
reach training. Each transfer's bytes are hashed per 1 MiB extent of the file (absolute
offsets) as they pass through the host staging buffer, in the I/O worker thread that
moves them, and the sums are checked when the same range is read back; a mismatch
raises ``IntegrityError`` naming the file, the offset and the state it holds, from the
read's ``wait()``, so the caller never decodes the bytes. The hash is linear: the
64-bit wrapping sum of every 8-byte word times an odd multiplier that depends on the
word's position (an odd lane constant times an odd page factor). Any single flipped
bit changes it by +-2^b times an odd number, never 0 mod 2^64, so it is always caught,
and a page written or read at the wrong place is caught too (its factor differs). Being
linear, an extent's sum can be put together from the pieces of any chunking, so it
does not depend on the staging size. It runs as one int64 mat-vec per chunk (no
temporary as large as the chunk; a multiply-then-sum is several times slower), faster on
one core than the disks it checks (docs/benchmarks.md, 'Design measurements'). A chunk
is hashed off its worker's path: a written chunk on a hashing thread while the worker
writes it out, a read chunk while its DMA to the device runs. Hashing
on the host by default: the staging buffer is where the bytes leave for, and arrive
from, the disk (so that is what is verified), it is aligned and padded (the device
tensor is neither at its tail), and the same code serves CPU and CUDA tensors; the
exception is Note [sums on the device]. Where the sums live: in memory per open file,
keyed by the transfer's range (the actor's offload file: it is rewritten every sleep
and never copied), or in a table at the end of the file itself (``checksums="file"``,
the optimizer's bucket files: the checkpoint copies the table with the bytes, so a
loaded checkpoint is verified on its first read like any other state). A compressed
file's sums cover each frame's record too (Note [summed records] of
``greenroom.io.statefile``). The files are
wiped at start, so a sum never outlives the process that wrote it unless the file
was copied with it. ``GREENROOM_VERIFY=0`` (or ``TransferEngine(verify=False)``) skips
hashing altogether; it exists to measure the cost, and state written that way cannot
be read back with verification on.

Note [sums on the device]: a chunk of a compressed file with frames for a GPU codec goes
to the device anyway, in one copy of its stored bytes (aligned, padded, whole pages),
for the codec to decode from. Its sums are taken there, from that copy, by the same
linear formula (``lane_dot``): bit for bit the sums the host would get, of the very
bytes the codec then decodes, at device speed, and the staging buffer goes back to the
engine as soon as the copy is done (Note [decode after the slot] of greenroom.io.frames).
Hashed on the host, the buffer stayed out of the next read for the hash: a wake's reads
finished together and were hashed together with no read in flight, for a share of every
wake (docs/benchmarks.md, 'Design measurements').
"""

from __future__ import annotations

import os

import torch

from greenroom.errors import ConfigError

ALIGNMENT = 4096  # the unit of O_DIRECT (``statefile`` Note [alignment]) and of the checksums' pages
EXTENT = 1 << 20  # bytes per checksum


def align_up(n: int, alignment: int = ALIGNMENT) -> int:
    return (n + alignment - 1) // alignment * alignment


def verify_default() -> bool:
    """Whether transfers are checksummed: ``GREENROOM_VERIFY`` (1, the default, or 0)."""
    value = os.environ.get("GREENROOM_VERIFY", "1")
    if value not in ("0", "1"):
        raise ConfigError(
            f"GREENROOM_VERIFY={value!r}: expected 1 (verify every read, the default) or 0 (measurement only)"
        )
    return value == "1"


def _signed(x: int) -> int:
    x &= (1 << 64) - 1
    return x - (1 << 64) if x >> 63 else x


def _mix(x: int) -> int:
    """splitmix64's finalizer: fixed, well-spread 64-bit constants from an index."""
    x = (x + 0x9E3779B97F4A7C15) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def engine_owned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in numpy-owned memory. The portable actor offload moves every
    torch-owned (resizable) storage it can reach; the engine's own bookkeeping must stay
    put while the actor sleeps, since the wake's reads are verified with it."""
    return torch.from_numpy(t.numpy().copy())


_WORDS_PER_PAGE = ALIGNMENT // 8
_LANES = engine_owned(torch.tensor([_signed(_mix(j) | 1) for j in range(_WORDS_PER_PAGE)], dtype=torch.int64))
_PAGE_A = _signed(_mix(1 << 20) | 1)
_PAGE_B = _signed(_mix(1 << 21))


_RECORD_FACTOR = _signed(_mix(1 << 22) | 1)


def record_mix(stored: torch.Tensor) -> torch.Tensor:
    """What each extent's sum adds for its frame's record in a compressed file (Note
    [summed records] of ``greenroom.io.statefile``): the record's 8 bytes (``stored``, int32
    pairs of stored bytes and shift) as one word, times an odd constant. Multiplying by an
    odd number is one-to-one mod 2^64, so a record that changes in any way changes it."""
    return stored.contiguous().view(torch.int64).view(-1) * _RECORD_FACTOR


_PAGES_PER_PRODUCT = 4096  # 16 MiB of pages: bounds the temporary of the elementwise form


def _sliced_lane_dot(words: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    return torch.cat([(part * lanes).sum(dim=1) for part in words.split(_PAGES_PER_PRODUCT)])


def lane_dot(words: torch.Tensor, lanes: torch.Tensor) -> torch.Tensor:
    """Each row of ``words`` (pages of int64 words) dotted with ``lanes``, wrapping mod
    2^64. A mat-vec on the host; on CUDA, which has no int64 mat-vec, a product and a sum
    per slice of pages: the same wrapping arithmetic, so the same sums to the bit."""
    return _sliced_lane_dot(words, lanes) if words.is_cuda else words @ lanes


def page_sums(buf: torch.Tensor, file_offset: int) -> torch.Tensor:
    """Each 4 KiB page's share of the checksum (Note [integrity]) of ``buf``, bytes that
    sit at ``file_offset`` of a file; ``buf`` is whole pages of 8-byte aligned memory, on
    the host or (Note [sums on the device]) on a CUDA device."""
    assert buf.numel() % ALIGNMENT == 0 and file_offset % ALIGNMENT == 0
    words = buf.view(torch.int64).view(-1, _WORDS_PER_PAGE)
    pages = torch.arange(
        file_offset // ALIGNMENT, file_offset // ALIGNMENT + words.shape[0], dtype=torch.int64, device=buf.device
    )
    lanes = _LANES if not buf.is_cuda else _LANES.to(buf.device, non_blocking=True)
    return lane_dot(words, lanes) * ((pages * _PAGE_A + _PAGE_B) | 1)


def extent_sums(buf: torch.Tensor, file_offset: int) -> torch.Tensor:
    """The checksum of every ``EXTENT`` of the file that ``buf`` (at ``file_offset``)
    touches, counting only ``buf``'s bytes."""
    sums = page_sums(buf, file_offset)
    first = file_offset // EXTENT
    index = (torch.arange(sums.numel(), dtype=torch.int64) * ALIGNMENT + file_offset) // EXTENT - first
    return torch.zeros(int(index[-1]) + 1 if sums.numel() else 0, dtype=torch.int64).index_add_(0, index, sums)
