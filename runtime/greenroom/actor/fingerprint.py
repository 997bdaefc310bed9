"""A keyed 128-bit fingerprint of a block of device memory, computed where it lives.

Used to tell whether a block changed since the last sleep wrote it (then its bytes on
disk are still right and need not be written again). It runs on the device at memory
bandwidth, so checking costs far less than writing.

Construction: the block is read as 64-bit words w_i. Each word is mixed with its index
and a per-process random key by a bijection of the word (xor, multiply by an odd
constant, logical xorshift, twice), and the mixed words are summed modulo 2^64. Two
lanes with independent keys give 128 bits. Because the mix is a bijection of w_i for a
fixed i, changing any single word changes that word's term and therefore the sum: a
one-word (and so a one-byte) change is always detected. Changes to several words
collide only by chance, about 2^-128 with the keys unknown to whoever wrote the data
(they are drawn from os.urandom in each process, and nothing is compared across
processes).
"""

from __future__ import annotations

import os

import torch

CHUNK_WORDS = 4 << 20  # 32 MiB of words per pass: bounded temporaries on a full device
_MASK = {shift: (1 << (64 - shift)) - 1 for shift in (29, 31, 32, 33)}


def _odd_key() -> int:
    return (int.from_bytes(os.urandom(8), "little") >> 2) | 1  # < 2^62: a positive int64


_LANES = [(_odd_key(), _odd_key(), _odd_key()) for _ in range(2)]


def _mix_sum(words: torch.Tensor, first_index: int, keys: tuple[int, int, int]) -> torch.Tensor:
    k0, k1, k2 = keys
    index = torch.arange(first_index, first_index + words.numel(), dtype=torch.int64, device=words.device)
    x = torch.bitwise_xor(words, index.mul_(k0)).mul_(k1)
    x.bitwise_xor_(x.bitwise_right_shift(31).bitwise_and_(_MASK[31]))  # logical: int64 shifts are arithmetic
    x.mul_(k2)
    x.bitwise_xor_(x.bitwise_right_shift(29).bitwise_and_(_MASK[29]))
    return x.sum()


def fingerprint(data: torch.Tensor) -> tuple[int, int]:
    """The fingerprint of a flat uint8 tensor (any device)."""
    assert data.dtype == torch.uint8 and data.dim() == 1
    n = data.numel()
    whole = n // 8 * 8
    words = data[:whole].view(torch.int64)
    if whole < n:  # the tail, zero-padded to a word; the length below keeps it distinct
        tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
        tail[: n - whole] = data[whole:]
        words = torch.cat([words, tail.view(torch.int64)])
    sums = torch.zeros(len(_LANES), dtype=torch.int64, device=data.device)
    for start in range(0, words.numel(), CHUNK_WORDS):
        chunk = words[start : start + CHUNK_WORDS]
        for lane, keys in enumerate(_LANES):
            sums[lane] += _mix_sum(chunk, start, keys)
    lanes = sums.tolist()
    return (lanes[0] ^ n, lanes[1])
