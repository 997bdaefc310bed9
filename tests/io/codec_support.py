"""What the host-codec tests share (tests/io/test_compression.py, tests/io/test_frames.py):
the staging size, the ``zstd`` codec fixture and compressible data."""

import pytest
import torch

from greenroom.io import compression

CHUNK = 8 << 20  # 2 MiB staging buffers: transfers span several chunks and frames


@pytest.fixture(scope="module")
def zstd():
    return compression.resolve("zstd", cuda=False, chunk_bytes=CHUNK).codec


def compressible(dtype: torch.dtype, n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.uint8:
        return torch.randint(0, 4, (n,), dtype=torch.uint8, generator=g)  # 2 bits of entropy per byte
    return (torch.randn(n, generator=g) * 1e-3).to(dtype)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)
