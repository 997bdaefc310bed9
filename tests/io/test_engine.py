"""The shared I/O layer: bit-exact round trips of odd sizes, with and without O_DIRECT,
clear errors for wrong-length files and a full disk, and no partial files left."""

import os
import shutil
import subprocess

import pytest
import torch

from greenroom.config import OffloadConfig
from greenroom.errors import StorageError
from greenroom.io import fs
from greenroom.io.engine import ALIGNMENT, StagingBuffers, StateFile, TransferEngine, align_up

ODD_SIZES = [1, 7, 199, 4095, 4096, 4097, 65536 + 3, 1 << 20, 3 * (1 << 20) + 13]


@pytest.fixture(params=[True, False], ids=["o_direct", "buffered"])
def direct(request, disk_dir):
    if request.param and not fs.supports_o_direct(disk_dir):
        pytest.skip(f"{disk_dir} does not support O_DIRECT")
    return request.param


@pytest.mark.parametrize("depth", [1, 3])
def test_round_trip_odd_sizes_bit_exact(disk_dir, direct, depth):
    # A staging budget smaller than most tensors forces many chunks and buffer reuse.
    with TransferEngine(256 * 1024, depth=depth) as engine:
        for n in ODD_SIZES:
            src = torch.randint(0, 256, (n,), dtype=torch.uint8)
            offset = ALIGNMENT * 3
            with StateFile(os.path.join(disk_dir, f"f{n}"), offset + n, direct=direct) as f:
                assert f.direct is direct
                engine.write(src, f, offset).wait()
                back = torch.empty_like(src)
                engine.read(back, f, offset).wait()
            assert torch.equal(src, back), n


def test_round_trip_of_float_dtypes_and_overlapping_transfers(disk_dir, direct):
    tensors = [
        torch.randn(1000, 37, dtype=torch.bfloat16),
        torch.randn(12345),
        torch.randn(3, 5, 7, dtype=torch.float16),
        torch.tensor(3.5, dtype=torch.float64),
    ]
    offsets, total = [], 0
    for t in tensors:
        offsets.append(total)
        total += align_up(t.numel() * t.element_size())
    with (
        TransferEngine(64 * 1024, depth=4) as engine,
        StateFile(os.path.join(disk_dir, "mixed"), total, direct=direct) as f,
    ):
        writes = [engine.write(t, f, o) for t, o in zip(tensors, offsets)]  # all in flight at once
        for w in writes:
            w.wait()
        backs = [torch.empty_like(t) for t in tensors]
        reads = [engine.read(b, f, o) for b, o in zip(backs, offsets)]
        for r in reads:
            r.wait()
    for t, b in zip(tensors, backs):
        assert torch.equal(t, b)


def test_staging_is_bounded_by_the_chunk_and_aligned():
    staging = StagingBuffers(1 << 20, depth=4, pin=False)
    assert staging.total_bytes <= 1 << 20
    assert all(b.data_ptr() % ALIGNMENT == 0 for b in staging.buffers)


def test_wrong_length_file_is_refused(disk_dir):
    path = os.path.join(disk_dir, "state")
    StateFile(path, 10000).close()
    with open(path, "r+b") as f:
        f.truncate(4096)
    with pytest.raises(StorageError, match=r"state: file is 4096 bytes, expected 12288: truncated"):
        StateFile(path, 10000, create=False)
    with pytest.raises(StorageError, match="state file is missing"):
        StateFile(os.path.join(disk_dir, "absent"), 10, create=False)


def test_buffered_io_drops_its_pages(disk_dir):
    path = os.path.join(disk_dir, "cached")
    with TransferEngine(1 << 20) as engine, StateFile(path, 8 << 20, direct=False) as f:
        engine.write(torch.ones(8 << 20, dtype=torch.uint8), f, 0).wait()
    # mincore is not in the stdlib; fincore (util-linux) reports resident pages.
    if shutil.which("fincore") is None:
        pytest.skip("fincore (util-linux) not available")
    out = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", path], capture_output=True, text=True, check=True
    )
    assert int(out.stdout.split()[0]) < (8 << 20) // 4


def test_running_out_of_space_is_a_clear_error_at_setup_with_no_partial_file(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to mount a size-limited filesystem")
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)]).returncode != 0:
        pytest.skip("cannot mount a size-limited tmpfs here")
    try:
        with pytest.warns(UserWarning, match="--allow-tmpfs"):
            config = OffloadConfig(
                stream_optimizer_state_to_disk=True, offload_train_disk_dir=str(mnt), allow_tmpfs=True
            )
        path = os.path.join(config.offload_train_disk_dir, "bucket0")
        with pytest.raises(StorageError, match=r"bucket0: not enough space to preallocate 16.0 MiB .* free"):
            StateFile(path, 16 << 20)
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_io_errors_reach_the_caller(disk_dir):
    with TransferEngine(1 << 16) as engine:
        f = StateFile(os.path.join(disk_dir, "closed"), 1 << 16, direct=False)
        f.close()
        transfer = engine.write(torch.zeros(1 << 16, dtype=torch.uint8), f, 0)
        with pytest.raises(
            StorageError,
            match=r"closed: write of 16384 bytes at offset \d+ of a state file failed: "
            r"Bad file descriptor \(EBADF\)",
        ):
            transfer.wait()


@pytest.mark.gpu
def test_cuda_tensors_round_trip_bit_exact_through_pinned_staging(disk_dir):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU machine)")
    with TransferEngine(1 << 20, depth=4) as engine:
        assert engine.staging.pinned
        for n in ODD_SIZES:
            src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
            with StateFile(os.path.join(disk_dir, f"g{n}"), n) as f:
                src.add_(1)  # queued on the current stream: the write must see it
                engine.write(src, f, 0).wait()
                back = torch.zeros_like(src)
                engine.read(back, f, 0).wait()
            assert torch.equal(src, back), n


def test_engine_keeps_no_reference_to_a_finished_transfer(disk_dir):
    import gc
    import weakref

    with TransferEngine(1 << 16) as engine, StateFile(os.path.join(disk_dir, "ref"), 1 << 16) as f:
        tensor = torch.ones(1 << 16, dtype=torch.uint8)
        ref = weakref.ref(tensor)
        engine.write(tensor, f, 0).wait()
        engine.drain()
        del tensor
        gc.collect()
        # The caller's memory must be freeable once its transfer is done (a sleeping
        # actor gives its device memory back this way).
        assert ref() is None


def test_a_range_outside_the_file_or_unaligned_under_o_direct_is_a_value_error(disk_dir):
    with StateFile(os.path.join(disk_dir, "f"), 8192) as f:
        with pytest.raises(ValueError, match="outside the file's 8192 bytes"):
            f.write(memoryview(bytearray(4096)), 8192)
        if f.direct:
            with pytest.raises(ValueError, match="aligned offsets and lengths"):
                f.write(memoryview(bytearray(100)), 0)


def test_the_stream_splits_its_chunk_into_up_to_eight_buffers_of_at_least_32_mib(disk_dir):
    """The optimizer-state stream's staging depth (``staging.stream_depth``): 8 buffers of
    32 MiB for the default 256 MiB chunk, 4 where a chunk is too small for more of that
    size (their buffers still hold whole frames down to the smallest compressed chunk);
    the bucket store's engine is built with it and its staging adds up to the chunk."""
    from greenroom.io.staging import stream_depth
    from greenroom.optim.store.bucket_store import BucketStore, Entry

    mib = 1 << 20
    assert [stream_depth(n * mib) for n in (4, 64, 128, 160, 256, 1024)] == [4, 4, 4, 5, 8, 8]
    store = BucketStore([Entry(name="w", shape=(1000,))], disk_dir, bucket_numel=1000, chunk_bytes=256 * mib)
    try:
        assert len(store.engine.staging.buffers) == 8
        assert store.engine.staging.buffer_bytes == 32 * mib
    finally:
        store.close()
