"""How the Adam moments are stored: fp32, bf16, fp16, or fp8 with per-block scales.

A codec turns a flat fp32 moment on the device into the bytes of its file segment and
back. Every cast runs on the tensor's own device (the GPU in training), never the host.

``fp32``
    The bytes of the fp32 tensor: the segment *is* the working tensor, so no copy is
    made and the results are bit-identical to keeping the state resident.
``bf16`` / ``fp16``
    A round-to-nearest cast; 2 bytes per element. fp16 stores the second moment as its
    square root: squared grads fall below fp16's smallest subnormal (6e-8) all the time,
    and a second moment flushed to zero turns the update into ``exp_avg / eps``.
``fp8e4m3`` / ``fp8e5m2``
    Per-block scaling: the flat moment is cut into blocks of ``FP8_SCALE_BLOCK``
    elements; each block stores its elements divided by a per-block fp32 scale, and the
    scales follow the blocks in the same segment (``[blocks | scales]``), so a segment
    holds ``1 + 4 / FP8_SCALE_BLOCK`` bytes per element, as ``greenroom plan`` counts.

Note [fp8 scales]: a scale is the power of two that brings the block's largest
magnitude into ``[fmax / 2, fmax]`` after the cast (halved once more when the largest
element rounds down to exactly ``fmax / 2``). A power of two makes the division exact
(only the cast to fp8 rounds), and this canonical choice makes decode-then-encode
reproduce the same bytes, so a bucket whose params had no grad this step is written
back unchanged. The second
moment is stored as its square root (and squared on decode): Adam only ever uses
``sqrt(exp_avg_sq)``, and the root halves the dynamic range a block has to span, so far
fewer small entries of a block flush to zero next to its largest one.
"""

from __future__ import annotations

import torch

from greenroom.config import FP8_SCALE_BLOCK, MOMENT_DTYPES
from greenroom.errors import ConfigError

_CAST_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_FP8_DTYPES = {"fp8e4m3": torch.float8_e4m3fn, "fp8e5m2": torch.float8_e5m2}


class MomentCodec:
    """One moment dtype: segment sizes, and device-side encode/decode.

    Args:
        name: one of ``greenroom.config.MOMENT_DTYPES``.
        sqrt: store the square root (the second moment of the fp16 and fp8 codecs, see
            Note [fp8 scales]); ignored for fp32 and bf16, whose range needs no help.
    """

    __slots__ = ("name", "dtype", "fp8", "sqrt")

    def __init__(self, name: str, *, sqrt: bool = False) -> None:
        if name not in MOMENT_DTYPES:
            raise ConfigError(f"moment dtype: expected one of {', '.join(MOMENT_DTYPES)}, got {name!r}")
        self.name = name
        self.fp8 = name in _FP8_DTYPES
        self.dtype = _FP8_DTYPES[name] if self.fp8 else _CAST_DTYPES[name]
        self.sqrt = sqrt and name != "fp32" and name != "bf16"

    @property
    def identity(self) -> bool:
        """Whether the stored bytes are the fp32 working tensor itself."""
        return self.name == "fp32"

    def nbytes(self, numel: int) -> int:
        """Bytes of a segment holding ``numel`` elements (before 4 KiB alignment)."""
        if not self.fp8:
            return numel * self.dtype.itemsize
        blocks = _blocks(numel)
        return blocks * FP8_SCALE_BLOCK + blocks * 4

    def view(self, raw: torch.Tensor, numel: int) -> torch.Tensor:
        """The fp32 working tensor that *is* ``raw`` (identity codec only)."""
        assert self.identity
        return raw[: numel * 4].view(torch.float32)

    def encode(self, src: torch.Tensor, raw: torch.Tensor) -> None:
        """Store flat fp32 ``src`` into the uint8 segment ``raw`` (same device)."""
        numel = src.numel()
        values = src.sqrt() if self.sqrt else src
        if not self.fp8:
            raw[: numel * self.dtype.itemsize].view(self.dtype).copy_(values)
            return
        blocks = _blocks(numel)
        padded = torch.zeros(blocks * FP8_SCALE_BLOCK, dtype=torch.float32, device=src.device)
        padded[:numel].copy_(values)
        padded = padded.view(blocks, FP8_SCALE_BLOCK)
        absmax = padded.abs().amax(dim=1)
        fmax = torch.finfo(self.dtype).max
        # A power of two s with absmax / s in [fmax / 2, fmax): frexp's mantissa is in
        # [0.5, 1). All-zero blocks get 1.
        _, exponent = torch.frexp(absmax / fmax)
        ones = torch.ones_like(absmax)
        scale = torch.where(absmax > 0, torch.ldexp(ones, exponent), ones)
        scale = torch.where(absmax / scale > fmax, scale * 2, scale)  # the division above rounded up
        # Canonical form (see Note [fp8 scales]): if the largest element rounded down to
        # exactly fmax / 2, halve the scale, as encoding the decoded block would.
        largest = (padded / scale[:, None]).to(self.dtype).to(torch.float32).abs().amax(dim=1)
        scale = torch.where((largest <= fmax / 2) & (largest > 0), scale / 2, scale)
        data = raw[: blocks * FP8_SCALE_BLOCK].view(self.dtype).view(blocks, FP8_SCALE_BLOCK)
        data.copy_(padded / scale[:, None])
        raw[blocks * FP8_SCALE_BLOCK : blocks * (FP8_SCALE_BLOCK + 4)].view(torch.float32).copy_(scale)

    def decode(self, raw: torch.Tensor, dst: torch.Tensor) -> None:
        """Fill flat fp32 ``dst`` from the uint8 segment ``raw`` (same device)."""
        numel = dst.numel()
        if not self.fp8:
            dst.copy_(raw[: numel * self.dtype.itemsize].view(self.dtype))
        else:
            blocks = _blocks(numel)
            data = raw[: blocks * FP8_SCALE_BLOCK].view(self.dtype).view(blocks, FP8_SCALE_BLOCK)
            scale = raw[blocks * FP8_SCALE_BLOCK : blocks * (FP8_SCALE_BLOCK + 4)].view(torch.float32)
            dst.copy_((data.to(torch.float32) * scale[:, None]).view(-1)[:numel])
        if self.sqrt:
            dst.mul_(dst)  # squared in fp32: exact, so encoding it again gives the same bytes


def _blocks(numel: int) -> int:
    return (numel + FP8_SCALE_BLOCK - 1) // FP8_SCALE_BLOCK


def moment_codecs(name: str) -> tuple[MomentCodec, MomentCodec]:
    """The codecs of ``exp_avg`` and ``exp_avg_sq`` for moment dtype ``name``."""
    return MomentCodec(name), MomentCodec(name, sqrt=True)
