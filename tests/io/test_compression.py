"""The frame codec layer of the I/O engine (greenroom.io.compression), on the host codec.

The CI machines have no GPU, so these run ``zstd`` (the same frame format, header and
records as ``nvcomp-ans``, which tests/io/test_engine.py's CUDA cases and the GPU benches
cover). Every round trip is compared with ``torch.equal`` on the bytes.
"""

import os
import threading

import pytest
import torch

from greenroom.errors import CheckpointError, ConfigError, IntegrityError
from greenroom.io import compression, frames, nvcomp_codec
from greenroom.io.engine import EXTENT, StateFile, TransferEngine, align_up
from tests.io.codec_support import CHUNK, as_bytes, compressible, zstd

__all__ = ["zstd"]  # the fixture, imported for the tests below


@pytest.mark.parametrize("direct", [None, False], ids=["o_direct_if_possible", "buffered"])
@pytest.mark.parametrize("checksums", ["memory", "file"])
@pytest.mark.parametrize(
    "dtype, n",
    [
        (torch.float32, 3_000_001),
        (torch.bfloat16, 777_777),
        (torch.float16, 5),
        (torch.float64, 300_000),
        (torch.uint8, 4097),
        (torch.int32, EXTENT // 4),
    ],
)
def test_round_trips_are_bit_exact_for_every_dtype_and_odd_size(tmp_path, zstd, direct, checksums, dtype, n):
    t = compressible(dtype, n)
    f = StateFile(
        str(tmp_path / "state"), t.numel() * t.element_size(), checksums=checksums, compression=zstd, direct=direct
    )
    with f, TransferEngine(CHUNK) as engine:
        engine.write(t, f, 0).wait()
        back = torch.empty_like(t)
        engine.read(back, f, 0).wait()
        assert torch.equal(as_bytes(back), as_bytes(t))
        assert f.disk_bytes_read < f.disk_bytes_written + StateFile.table_bytes(f.size, compressed=True) + 1
        if n > 100_000:  # whole frames of low-entropy bytes shrink
            assert f.disk_bytes_written < t.numel() * t.element_size()


def test_a_transfer_at_an_unaligned_extent_offset_and_one_beside_it(tmp_path, zstd):
    # Two ranges of one file (the actor's offload file): the first ends inside an extent
    # that the second begins in, so frames of both live in one extent.
    a, b = compressible(torch.float32, 400_000, 1), compressible(torch.bfloat16, 900_001, 2)
    off_b = align_up(a.numel() * 4)
    with (
        StateFile(str(tmp_path / "state"), off_b + b.numel() * 2, compression=zstd) as f,
        TransferEngine(CHUNK) as engine,
    ):
        engine.write(a, f, 0).wait()
        engine.write(b, f, off_b).wait()
        back_a, back_b = torch.empty_like(a), torch.empty_like(b)
        engine.read(back_b, f, off_b).wait()
        engine.read(back_a, f, 0).wait()
    assert torch.equal(as_bytes(back_a), as_bytes(a)) and torch.equal(as_bytes(back_b), as_bytes(b))


def test_an_incompressible_frame_is_stored_raw(tmp_path, zstd):
    t = torch.randint(0, 256, (3 * EXTENT + 1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    with StateFile(str(tmp_path / "state"), t.numel(), compression=zstd) as f, TransferEngine(CHUNK) as engine:
        engine.write(t, f, 0).wait()
        stored = f.recorded(0, align_up(t.numel()))[1]
        assert stored.tolist() == [[EXTENT, 0], [EXTENT, 0], [EXTENT, 0], [1000, 0]]  # raw, at their own places
        assert f.disk_bytes_written == align_up(t.numel())
        back = torch.empty_like(t)
        engine.read(back, f, 0).wait()
    assert torch.equal(back, t)
    with open(f.path, "rb") as raw:  # raw frames are the bytes themselves
        assert raw.read(EXTENT) == t[:EXTENT].numpy().tobytes()


def _first_stored_frame(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read(compression.HEADER_BYTES)


@pytest.mark.parametrize("verify", ["1", "0"])
def test_a_corrupted_stored_frame_is_detected_naming_the_file_and_offset(tmp_path, zstd, monkeypatch, verify):
    # With verification on the engine's sums catch it; off (measurement only), the
    # codec's own checksum of the raw bytes still does.
    monkeypatch.setenv("GREENROOM_VERIFY", verify)
    t = compressible(torch.float32, 2 * EXTENT // 4)
    path = str(tmp_path / "state")
    with StateFile(path, t.numel() * 4, compression=zstd) as f, TransferEngine(CHUNK) as engine:
        engine.write(t, f, 0).wait()
        assert _first_stored_frame(path).startswith(compression.MAGIC)
        (first, _), (second, shift) = f.recorded(0, t.numel() * 4)[1].tolist()
        assert shift == EXTENT - align_up(first)  # packed right after the first frame
        flip_at = align_up(first) + second // 2  # inside the second frame's payload
        fd = os.open(path, os.O_RDWR)
        try:
            byte = os.pread(fd, 1, flip_at)
            os.pwrite(fd, bytes([byte[0] ^ 0x20]), flip_at)
        finally:
            os.close(fd)
        with pytest.raises(IntegrityError) as err:
            engine.read(torch.empty_like(t), f, 0).wait()
    message = str(err.value)
    assert "\n" not in message and path in message and f"offset {EXTENT}" in message


def test_a_damaged_header_is_refused(tmp_path, zstd):
    t = compressible(torch.float32, EXTENT // 4)
    path = str(tmp_path / "state")
    with (
        StateFile(path, t.numel() * 4, compression=zstd, checksums="memory") as f,
        TransferEngine(CHUNK, verify=False) as engine,
    ):
        engine.write(t, f, 0).wait()
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, b"XXXX", 0)  # the magic
        finally:
            os.close(fd)
        with pytest.raises(IntegrityError, match="header does not match"):
            engine.read(torch.empty_like(t), f, 0).wait()


def test_a_device_frame_in_a_file_of_a_host_codec_is_refused(tmp_path, zstd, monkeypatch):
    # A zstd file's frame whose header names nvcomp-ans: its bytes never went to the device,
    # so it is refused in one line, not decoded. nvCOMP cannot load on a machine without
    # CUDA, so the frame's codec is a stand-in that says it runs on the device.
    t = compressible(torch.float32, EXTENT // 4)
    path = str(tmp_path / "state")
    with StateFile(path, t.numel() * 4, compression=zstd, checksums="memory") as f, TransferEngine(CHUNK) as engine:
        engine.write(t, f, 0).wait()
        device_codec = type("DeviceCodec", (), {"name": "nvcomp-ans", "on_device": True})()
        monkeypatch.setattr(compression, "codec_by_id", lambda codec_id, where: device_codec)
        with pytest.raises(
            IntegrityError,
            match=r"state: frame at offset 0 of .*: the frame names codec "
            r"nvcomp-ans, but the file was opened for zstd",
        ):
            engine.read(torch.empty_like(t), f, 0).wait()


def test_none_stores_the_bytes_exactly_as_before(tmp_path):
    # compression None: the file is the tensor's bytes, then the checksum table, with the
    # sizes the layout had before compression existed.
    t = compressible(torch.float32, 1_000_003)
    nbytes = t.numel() * 4
    assert StateFile.file_bytes(nbytes, checksums="file") == align_up(nbytes) + align_up(
        (align_up(nbytes) + EXTENT - 1) // EXTENT * 8
    )
    path = str(tmp_path / "state")
    with StateFile(path, nbytes, checksums="file") as f, TransferEngine(CHUNK) as engine:
        engine.write(t, f, 0).wait()
    with open(path, "rb") as raw:
        data = raw.read()
    assert len(data) == StateFile.file_bytes(nbytes, checksums="file")
    assert data[:nbytes] == t.numpy().tobytes() and data[nbytes : align_up(nbytes)] == bytes(align_up(nbytes) - nbytes)


def test_flags_resolve_in_one_line_each():
    assert compression.resolve("none", cuda=False, chunk_bytes=CHUNK).codec is None
    r = compression.resolve("auto", cuda=False, chunk_bytes=CHUNK)
    codec, line = r.codec, r.line
    assert codec is None and "zstd" in line and "\n" not in line  # auto never picks the slow host codec
    r = compression.resolve("auto", cuda=True, chunk_bytes=CHUNK)
    codec, line = r.codec, r.line
    try:
        from nvidia import nvcomp  # noqa: F401
    except ImportError:  # the CI: auto says why none runs, and what to install
        assert codec is None and "nvCOMP does not load" in line and "nvidia-nvcomp-cu13" in line
    else:
        assert codec.name == "nvcomp-ans" and line == "compression: nvcomp-ans (auto)"
    r = compression.resolve("auto", cuda=True, chunk_bytes=2 << 20)
    codec, line = r.codec, r.line
    assert codec is None and "--offload-train-disk-chunk-mb is under 4" in line
    with pytest.raises(ConfigError, match="needs CUDA"):
        compression.resolve("nvcomp-ans", cuda=False, chunk_bytes=CHUNK)
    with pytest.raises(ConfigError, match="chunk-mb 4 or more"):
        compression.resolve("zstd", cuda=False, chunk_bytes=1 << 20)
    with pytest.raises(ConfigError, match="expected one of"):
        compression.resolve("lz4", cuda=False, chunk_bytes=CHUNK)


def _adamw_and_streaming(directory: str, compression_name: str, name: str = "optim"):
    from greenroom.optim import StreamingAdam

    torch.manual_seed(0)
    shapes = [(300, 700), (1000,), (512, 513)]
    ref = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    adamw = torch.optim.AdamW(ref, lr=1e-2, foreach=True)
    opt = StreamingAdam(
        ours,
        lr=1e-2,
        state_dir=os.path.join(directory, name),
        bucket_numel=200_000,
        chunk_mb=8,
        resident_numel=0,
        compression=compression_name,
    )
    return ref, ours, adamw, opt


def _step(params_pairs, optimizers, seed):
    g = torch.Generator().manual_seed(seed)
    grads = [torch.randn(p.shape, generator=g) for p in params_pairs[0]]
    for params, opt in zip(params_pairs, optimizers):
        for p, grad in zip(params, grads):
            p.grad = grad.to(p.device, copy=True)
        opt.step()


def test_streaming_adam_with_compressed_buckets_is_bit_identical_to_adamw(disk_dir):
    ref, ours, adamw, opt = _adamw_and_streaming(disk_dir, "zstd")
    try:
        assert opt.compression_line == "compression: zstd" and opt.store.layout()["compression"] == "zstd"
        for i in range(4):
            _step((ref, ours), (adamw, opt), i)
        assert all(torch.equal(a, b) for a, b in zip(ref, ours))
        assert opt.store.disk_bytes("written") < opt.store.bytes_written  # the moments shrink
        exported, expected = opt.state_dict(), adamw.state_dict()
        for i, state in expected["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(exported["state"][i][key], state[key])
    finally:
        opt.close()


def test_a_compressed_checkpoint_loads_and_a_mismatched_codec_is_refused(disk_dir):
    ref, ours, adamw, opt = _adamw_and_streaming(disk_dir, "zstd")
    ckpt = os.path.join(disk_dir, "ckpt")
    try:
        for i in range(2):
            _step((ref, ours), (adamw, opt), i)
        opt.save_checkpoint(ckpt)
    finally:
        opt.close()
    _, resumed_params, _, resumed = _adamw_and_streaming(disk_dir, "zstd", "resumed")
    try:
        for p, q in zip(resumed_params, ours):
            p.data.copy_(q)
        resumed.load_checkpoint(ckpt)
        for i in range(2, 4):
            _step((ref, resumed_params), (adamw, resumed), i)
        assert all(torch.equal(a, b) for a, b in zip(ref, resumed_params))
    finally:
        resumed.close()
    _, _, _, plain = _adamw_and_streaming(disk_dir, "none", "plain")
    try:
        with pytest.raises(CheckpointError) as err:
            plain.load_checkpoint(ckpt)
        assert "--offload-train-disk-compression zstd" in str(err.value) and "\n" not in str(err.value)
    finally:
        plain.close()


def test_disk_offload_with_compression_restores_every_byte(disk_dir):
    from greenroom.actor import build_offloader
    from greenroom.config import OffloadConfig
    from greenroom.dirs.rankdir import RankDir

    config = OffloadConfig(
        offload_train=True,
        offload_train_target="disk",
        offload_train_disk_dir=str(disk_dir),
        offload_train_disk_chunk_mb=8,
        offload_train_disk_compression="zstd",
    )
    with RankDir(str(disk_dir), role="actor", rank=0) as rank_dir:
        offloader = build_offloader(config, rank_dir, device="cpu", backend="portable", scope="tracked")
        with offloader:
            weights = compressible(torch.bfloat16, 3_000_000)
            noise = torch.randint(0, 256, (EXTENT + 5,), dtype=torch.uint8)
            expected = [weights.clone(), noise.clone()]
            offloader.track([weights, noise])
            for _ in range(2):
                offloader.sleep()
                offloader.wake()
                assert torch.equal(as_bytes(weights), as_bytes(expected[0])) and torch.equal(noise, expected[1])
            written = offloader.disk_bytes("written")
    assert written < 2 * (weights.numel() * 2 + noise.numel())  # two sleeps, the weights compressed


def test_plan_reports_the_expected_stored_bytes_beside_the_raw_size(disk_dir):
    import json
    import subprocess
    import sys

    def plan(codec: str) -> dict:
        out = subprocess.run(
            [
                sys.executable,
                "-m",
                "greenroom.cli.main",
                "plan",
                "--offload-train",
                "--offload-train-target",
                "disk",
                "--stream-optimizer-state-to-disk",
                "--offload-train-disk-dir",
                str(disk_dir),
                "--params",
                "1e6",
                "--offload-train-disk-compression",
                codec,
                "--json",
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        return json.loads(out)

    plain, packed = plan("none"), plan("zstd")
    assert plain["stored_bytes_per_rank"] == plain["disk_bytes_per_rank"]
    assert packed["disk_bytes_per_rank"] == plain["disk_bytes_per_rank"]  # files keep their raw size
    expected = 4e6 / compression.expected_ratio("zstd", "bf16 weights")  # the paused actor's weights + grads
    assert packed["stored_bytes_per_rank"]["offload"] == int(expected)
    assert packed["stored_bytes_per_rank"]["total"] < plain["disk_bytes_per_rank"]["total"]


def _nvcomp_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA (runs on the GPU machine)")
    try:
        return compression.resolve("nvcomp-ans", cuda=True, chunk_bytes=CHUNK).codec
    except ConfigError as e:
        pytest.skip(f"nvCOMP does not load here: {e}")


@pytest.mark.gpu
@pytest.mark.parametrize("checksums", ["memory", "file"])
# Note [copy while reading]: both settings, and pieces far smaller than a chunk.
@pytest.mark.parametrize(
    "device_reads", [frames.BESIDE_WRITES, frames.READS_ALONE, frames.DeviceReads(piece=256 << 10, in_flight=3)]
)
def test_nvcomp_round_trips_device_and_host_tensors_and_catches_a_flip(tmp_path, checksums, device_reads):
    codec = _nvcomp_or_skip()
    for dtype, n in ((torch.float32, 3_000_001), (torch.bfloat16, 777_777), (torch.uint8, 5000)):
        t = compressible(dtype, n).cuda()
        path = str(tmp_path / f"state-{n}")
        with (
            StateFile(path, t.numel() * t.element_size(), checksums=checksums, compression=codec) as f,
            TransferEngine(CHUNK, device_reads=device_reads) as engine,
        ):
            engine.write(t, f, 0).wait()
            back, host = torch.empty_like(t), torch.empty(t.shape, dtype=t.dtype)
            engine.read(back, f, 0).wait()
            engine.read(host, f, 0).wait()  # device-coded frames into a host tensor
            assert torch.equal(as_bytes(back), as_bytes(t)) and torch.equal(as_bytes(host), as_bytes(t.cpu()))
            if n > 100_000:
                assert _first_stored_frame(path).startswith(compression.MAGIC)
                fd = os.open(path, os.O_RDWR)
                try:
                    os.pwrite(fd, bytes([os.pread(fd, 1, 2000)[0] ^ 1]), 2000)
                finally:
                    os.close(fd)
                with pytest.raises(IntegrityError, match="offset 0"):
                    engine.read(back, f, 0).wait()


@pytest.mark.gpu
def test_a_failed_piece_of_a_device_read_is_reported_and_the_engine_reads_on(tmp_path, monkeypatch):
    # Note [copy while reading]: a read's pieces run on the engine's pool; one that fails
    # fails the transfer, and no piece still fills the buffer the next chunk gets.
    codec = _nvcomp_or_skip()
    t = compressible(torch.bfloat16, 6 * EXTENT).cuda()
    real_read, calls = StateFile.read, []

    def failing_read(self, buf, file_offset):
        calls.append(file_offset)
        if len(calls) == 5:
            raise OSError(5, "Input/output error")
        return real_read(self, buf, file_offset)

    small_pieces = frames.DeviceReads(piece=256 << 10, in_flight=8)
    with (
        StateFile(str(tmp_path / "state"), t.numel() * 2, compression=codec) as f,
        TransferEngine(4 * EXTENT, depth=2, device_reads=small_pieces) as engine,
    ):
        engine.write(t, f, 0).wait()
        back = torch.empty_like(t)
        monkeypatch.setattr(StateFile, "read", failing_read)
        with pytest.raises(OSError, match="Input/output error"):
            engine.read(back, f, 0).wait()
        monkeypatch.setattr(StateFile, "read", real_read)
        engine.read(back, f, 0).wait()
        assert torch.equal(as_bytes(back), as_bytes(t))


@pytest.mark.gpu
def test_device_chunks_encode_before_their_buffer_and_a_failed_encode_fails_only_its_write(tmp_path, monkeypatch):
    # Note [encode before the slot]: every encode of a device chunk runs on the engine's
    # encoder, not under a staging buffer; one that fails fails its transfer, and the
    # engine writes on.
    codec = _nvcomp_or_skip()
    t = compressible(torch.bfloat16, 12 * EXTENT).cuda()
    real_encode, threads = type(codec).encode, []

    def encode(self, views, itemsizes, stream):
        threads.append(threading.current_thread().name)
        if len(threads) == 3 and failing:
            raise RuntimeError("encode failed")
        return real_encode(self, views, itemsizes, stream)

    monkeypatch.setattr(type(codec), "encode", encode)
    failing = True
    with (
        StateFile(str(tmp_path / "state"), t.numel() * 2, compression=codec) as f,
        TransferEngine(4 * EXTENT, depth=2) as engine,
    ):
        with pytest.raises(RuntimeError, match="encode failed"):
            engine.write(t, f, 0).wait()
        failing = False
        engine.write(t, f, 0).wait()
        back = torch.empty_like(t)
        engine.read(back, f, 0).wait()
    assert torch.equal(as_bytes(back), as_bytes(t))
    assert len(threads) > 6 and set(threads) == {"greenroom-encode_0"}


@pytest.mark.gpu
def test_nvcomp_keeps_the_smaller_coding_of_a_16_bit_frame_and_reads_both(tmp_path):
    # Note [16-bit frames] of greenroom.io.nvcomp_codec: a bf16 frame is coded as byte
    # planes and in nvCOMP's 16-bit mode and stores the smaller, under that mode's codec id;
    # a chunk that mixes them with 4-byte frames round-trips; a frame of either coding
    # decodes.
    codec = _nvcomp_or_skip()
    half = compressible(torch.bfloat16, 3 * EXTENT // 2).cuda()
    full = compressible(torch.float32, 3 * EXTENT // 4 + 11).cuda()
    state = torch.cat([as_bytes(half), as_bytes(full)])
    path = str(tmp_path / "mixed")
    with StateFile(path, state.numel(), compression=codec) as f, TransferEngine(CHUNK) as engine:
        engine.write(state, f, 0, element_sizes=((0, 2), (half.numel() * 2, 4))).wait()
        back = torch.empty_like(state)
        engine.read(back, f, 0).wait()
        assert torch.equal(back, state)
    stream = torch.cuda.Stream()
    frame = as_bytes(half)[:EXTENT]
    sizes = {
        codec.id: codec._encode([frame], [2], stream, half=False)[0].numel(),
        nvcomp_codec.NVCOMP_F16_ID: codec._encode([frame], [2], stream, half=True)[0].numel(),
    }
    magic, codec_id, itemsize, raw, payload = compression._HEADER.unpack_from(_first_stored_frame(path))
    assert (magic, itemsize, raw) == (compression.MAGIC, 2, EXTENT)
    assert payload == sizes[codec_id] == min(sizes.values())
    for codec_id in sizes:
        (payload,) = codec._encode([frame], [2], stream, half=codec_id == nvcomp_codec.NVCOMP_F16_ID)
        with torch.cuda.stream(stream):
            packed = torch.zeros(payload.numel() + 256, dtype=torch.uint8, device="cuda")
            packed[256:].copy_(payload)
            out = torch.empty_like(frame)
        codec.decode(packed, [(256, payload.numel())], [out], [(codec_id, 2)], stream, ["frame"])
        assert torch.equal(out, frame)


@pytest.mark.gpu
def test_the_engine_keeps_decoders_while_it_reads_and_drops_them_after(tmp_path, monkeypatch):
    # Note [kept decoders] of greenroom.io.kept_decoders: chunks of both codings decode
    # bit-exact on decoders kept on one decode stream per device; once the reads are waited
    # for, none is kept (a sleeping actor gives their scratch back).
    codec = _nvcomp_or_skip()
    made = []
    real_codec = nvcomp_codec.NvcompPlanes._codec

    def counting_codec(self, stream, half, *, encoding):
        if not encoding:
            made.append(stream)
        return real_codec(self, stream, half, encoding=encoding)

    monkeypatch.setattr(nvcomp_codec.NvcompPlanes, "_codec", counting_codec)
    half = compressible(torch.bfloat16, 12 * EXTENT // 2).cuda()
    full = compressible(torch.float32, 12 * EXTENT // 4 + 11, seed=1).cuda()
    state = torch.cat([as_bytes(half), as_bytes(full)])
    with (
        StateFile(str(tmp_path / "state"), state.numel(), compression=codec) as f,
        TransferEngine(4 * EXTENT, depth=2, device_reads=frames.READS_ALONE) as engine,
    ):
        engine.write(state, f, 0, element_sizes=((0, 2), (half.numel() * 2, 4))).wait()
        for _ in range(2):
            back = torch.empty_like(state)
            engine.read(back, f, 0).wait()
            assert torch.equal(back, state)
            assert engine.frame_io.kept_decoders.held() == 0
    # At most one decoder per coding on each decode stream, whatever the I/O threads: the
    # bound on kept scratch. (On the H100: 4 decoders for the two reads' 26 chunks.)
    streams = {s.cuda_stream for s in made}
    assert streams and len(made) <= 2 * len(streams)


@pytest.mark.gpu
def test_nvcomp_decodes_frames_coded_with_nvcomps_default_chunks(tmp_path):
    # Note [ANS chunks] of greenroom.io.nvcomp_codec: files written before the chunk options
    # (nvCOMP's 64 KiB chunks of 8 sub-chunks) still read: the bitstream records how it was
    # cut.
    codec = _nvcomp_or_skip()
    from nvidia import nvcomp

    stream = torch.cuda.Stream()
    frame = as_bytes(compressible(torch.bfloat16, EXTENT // 2).cuda())
    for codec_id, options in ((codec.id, {}), (nvcomp_codec.NVCOMP_F16_ID, {"data_type": "<f2"})):
        coded = codec._encode([frame], [2], stream, half=codec_id == nvcomp_codec.NVCOMP_F16_ID)[0]
        planes = frame if options else frame.view(-1, 2).t().contiguous().view(-1)
        with torch.cuda.stream(stream):
            old = nvcomp.Codec(
                algorithm="ANS", device_id=frame.device.index, cuda_stream=stream.cuda_stream, **options
            ).encode(nvcomp.as_array(planes))
            old = torch.as_tensor(old, device=frame.device).view(torch.uint8).reshape(-1).clone()
        stream.synchronize()
        assert not torch.equal(old, coded)  # the options changed the bitstream
        out = torch.empty_like(frame)
        codec.decode(old, [(0, old.numel())], [out], [(codec_id, 2)], stream, ["frame"])
        assert torch.equal(out, frame)


def test_bench_codec_fails_a_codec_that_decodes_wrong_bytes(monkeypatch, capsys):
    import argparse
    import json

    from greenroom.cli.bench import codec as bench_codec

    real_decode = compression.ZstdPlanes.decode

    def decode_one_bit_off(self, payload, out, itemsize, where):
        real_decode(self, payload, out, itemsize, where)
        out[0] ^= 1

    monkeypatch.setattr(compression.ZstdPlanes, "decode", decode_one_bit_off)
    parser = argparse.ArgumentParser()
    bench_codec.configure_parser(parser)
    args = parser.parse_args(
        ["--compression", "zstd", "--state", "random", "--size", "64MiB", "--threads", "2", "--json"]
    )
    assert bench_codec.run(args) == 1
    assert json.loads(capsys.readouterr().out)["bit_exact"] is False


@pytest.mark.gpu
def test_nvcomp_payloads_depend_on_the_frame_alone_not_on_what_the_memory_held():
    # Stored bytes are a function of the state (the engine zeroes its padding too): the
    # same frames encoded before and after the allocator's pool was filled with other
    # bytes give the same payloads, of both codings. With nvCOMP's scratch left as the
    # pool held it, fp32 frames differed at 122-193 bytes even encoded twice in a row.
    codec = _nvcomp_or_skip()
    stream = torch.cuda.Stream()
    for seed, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        size = dtype.itemsize
        frames_in = list(compressible(dtype, 4 * EXTENT // size, seed).cuda().view(torch.uint8).view(-1, EXTENT))
        first = [(codec_id, payload.clone()) for codec_id, payload in codec.encode(frames_in, [size] * 4, stream)]
        with torch.cuda.stream(stream):  # the pool the encoder allocates from
            for fill in (0xB6, 0x5A):
                junk = torch.full((256 << 20,), fill, dtype=torch.uint8, device="cuda")
                stream.synchronize()
                del junk
        again = codec.encode(frames_in, [size] * 4, stream)
        assert [c for c, _ in first] == [c for c, _ in again]
        assert all(torch.equal(a, b) for (_, a), (_, b) in zip(first, again))


@pytest.mark.gpu
def test_nvcomp_decoders_kept_by_the_caller_decode_other_chunks_bit_exact():
    # bench codec's decode_kept figure: one dict of decoders per stream, reused on chunks
    # it has not seen, of both codings (planes and the 16-bit mode).
    codec = _nvcomp_or_skip()
    stream, decoders = torch.cuda.Stream(), {}
    for seed, dtype in ((0, torch.float32), (1, torch.bfloat16), (2, torch.float32), (3, torch.bfloat16)):
        size = dtype.itemsize
        frames_in = list(compressible(dtype, 4 * EXTENT // size, seed).cuda().view(torch.uint8).view(-1, EXTENT))
        coded = codec.encode(frames_in, [size] * 4, stream)
        spans, at = [], 0
        for _, payload in coded:
            spans.append((at, payload.numel()))
            at += align_up(payload.numel(), 256)
        packed = torch.zeros(at, dtype=torch.uint8, device="cuda")
        for (start, n), (_, payload) in zip(spans, coded):
            packed[start : start + n].copy_(payload)
        outs = [torch.empty(EXTENT, dtype=torch.uint8, device="cuda") for _ in coded]
        codec.decode(
            packed, spans, outs, [(codec_id, size) for codec_id, _ in coded], stream, ["t"] * 4, decoders=decoders
        )
        assert all(torch.equal(o, f) for o, f in zip(outs, frames_in))
    assert decoders and set(decoders) <= {False, True}


@pytest.mark.gpu
def test_bench_codec_on_the_gpu_reports_kept_decoders_and_round_trips():
    import json
    import subprocess
    import sys

    _nvcomp_or_skip()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "greenroom.cli.main",
            "bench",
            "codec",
            "--compression",
            "nvcomp-ans",
            "--state",
            "random",
            "--size",
            "128MiB",
            "--threads",
            "2",
            "--json",
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["bit_exact"] and result["decode_kept_bytes_per_s"] > 0


@pytest.mark.gpu
def test_streaming_adam_with_nvcomp_is_bit_identical_to_fused_adamw(disk_dir):
    _nvcomp_or_skip()
    from greenroom.optim import StreamingAdam

    torch.manual_seed(0)
    ref = [torch.nn.Parameter(torch.randn(s, device="cuda")) for s in [(1024, 1024), (4099,), (333, 777)]]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in ref]
    adamw = torch.optim.AdamW(ref, lr=1e-2, weight_decay=0.01, fused=True)
    opt = StreamingAdam(
        ours,
        lr=1e-2,
        weight_decay=0.01,
        state_dir=os.path.join(disk_dir, "optim"),
        bucket_numel=1 << 19,
        chunk_mb=8,
        resident_numel=0,
        compression="nvcomp-ans",
    )
    try:
        for i in range(4):
            _step((ref, ours), (adamw, opt), i)
        assert all(torch.equal(a, b) for a, b in zip(ref, ours))
        assert opt.store.disk_bytes("written") < opt.store.bytes_written
        exported = opt.state_dict()
        for i, state in adamw.state_dict()["state"].items():
            assert torch.equal(exported["state"][i]["exp_avg"], state["exp_avg"].cpu())
    finally:
        opt.close()


def test_bench_codec_times_the_codec_and_refuses_bad_input():
    import json
    import subprocess
    import sys

    def bench(*extra):
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "greenroom.cli.main",
                "bench",
                "codec",
                "--compression",
                "zstd",
                "--state",
                "random",
                "--size",
                "64MiB",
                *extra,
            ],
            capture_output=True,
            text=True,
        )

    result = json.loads(bench("--threads", "2", "--json").stdout)
    assert result["bytes"] == 64 << 20 and result["ratio"] < compression.MIN_RATIO  # random bytes do not shrink
    assert result["encode_bytes_per_s"] > 0 and result["decode_bytes_per_s"] > 0 and result["bit_exact"]
    assert "decode_kept_bytes_per_s" not in result  # zstd's contexts are kept per thread already
    bad = bench("--threads", "0")
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--threads" in bad.stderr


def test_runs_join_only_frames_back_to_back_in_one_storage_of_one_length_and_element_size():
    # Note [batched decode] of greenroom.io.nvcomp_codec: a run's planes move in one kernel
    # through one strided view, so a run must never reach past its first frame's storage,
    # even where the allocator put a second tensor right behind it.
    n = 4 * 256
    chunk = torch.zeros(8 * n, dtype=torch.uint8)
    frames_in = list(chunk.view(8, n))
    assert list(nvcomp_codec._runs(frames_in, [4] * 8)) == [(0, 8)]
    assert list(nvcomp_codec._runs(frames_in, [4, 4, 2, 2, 2, 4, 4, 4])) == [(0, 2), (2, 5), (5, 8)]
    skipping = [frames_in[0], frames_in[1], frames_in[3], frames_in[4]]
    assert list(nvcomp_codec._runs(skipping, [4] * 4)) == [(0, 2), (2, 4)]
    odd = [chunk[: n + 16], chunk[n + 16 : 2 * n + 32]]  # not a multiple of the batch alignment
    assert list(nvcomp_codec._runs(odd, [4, 4])) == [(0, 1), (1, 2)]
    short_last = [frames_in[0], frames_in[1], chunk[2 * n : 2 * n + 512]]
    assert list(nvcomp_codec._runs(short_last, [4] * 3)) == [(0, 2), (2, 3)]

    class AdjacentStorage:  # a tensor of another storage that starts where the run ends
        def __init__(self, tensor, ptr):
            self.tensor, self.ptr = tensor, ptr

        def numel(self):
            return self.tensor.numel()

        def data_ptr(self):
            return self.ptr

        def untyped_storage(self):
            return torch.zeros(1, dtype=torch.uint8).untyped_storage()

    other = AdjacentStorage(torch.zeros(n, dtype=torch.uint8), frames_in[1].data_ptr() + n)
    assert list(nvcomp_codec._runs([frames_in[0], frames_in[1], other], [4] * 3)) == [(0, 2), (2, 3)]


@pytest.mark.gpu
def test_nvcomp_decode_refuses_a_payload_of_another_length_or_cut_short_in_one_line():
    # Note [batched decode] of greenroom.io.nvcomp_codec: decoded into a fixed buffer per
    # frame, a payload that decodes shorter than its frame, or noise that does not decode,
    # is an IntegrityError naming it.
    codec = _nvcomp_or_skip()
    stream = torch.cuda.Stream()
    frame = as_bytes(compressible(torch.float32, EXTENT // 4).cuda())
    ((codec_id, payload),) = codec.encode([frame[: EXTENT // 2]], [4], stream)
    with torch.cuda.stream(stream):
        packed = payload.clone()
        out = torch.empty_like(frame)
    with pytest.raises(
        IntegrityError, match=f"frame: the compressed frame decodes to {EXTENT // 2} bytes, expected {EXTENT}"
    ):
        codec.decode(packed, [(0, packed.numel())], [out], [(codec_id, 4)], stream, ["frame"])
    with torch.cuda.stream(stream):
        noise = torch.randint(0, 256, (4096,), dtype=torch.uint8, device="cuda")
    with pytest.raises(
        IntegrityError, match="^frame: (a compressed frame does not decode|the compressed frame decodes to)"
    ):
        codec.decode(noise, [(0, noise.numel())], [out[: EXTENT // 2]], [(codec_id, 4)], stream, ["frame"])
    codec.decode(packed, [(0, packed.numel())], [out[: EXTENT // 2]], [(codec_id, 4)], stream, ["frame"])
    assert torch.equal(out[: EXTENT // 2], frame[: EXTENT // 2])


def test_a_resolved_codec_is_taken_as_it_is_only_for_its_device_and_chunk():
    once = compression.resolve("zstd", cuda=False, chunk_bytes=CHUNK)
    assert compression.resolved(once, cuda=False, chunk_bytes=CHUNK, what="StreamingAdam") is once
    with pytest.raises(ConfigError, match="^StreamingAdam: compression 'zstd' was resolved for the host with a 8 MiB"):
        compression.resolved(once, cuda=False, chunk_bytes=CHUNK // 2, what="StreamingAdam")
