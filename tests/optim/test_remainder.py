"""Note [remainder]: a bf16 param's fp32 master stored as its low 16 bits beside the param,
exactly, for every bit pattern; params changed from outside re-seed their blocks."""

import pytest
import torch

from greenroom.errors import CheckpointError, GreenroomError
from greenroom.optim import StreamingAdam, remainder
from greenroom.optim.store.bucket_store import BucketStore, Entry
from tests.optim.support import ODD_SHAPES, set_grads, step_beside_fp32_masters, twins

_LOWS = (0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x1234)


def _every_pattern() -> torch.Tensor:
    """fp32 masters with every high half (every bf16 pattern: ±0, subnormals, normals,
    ±inf, every NaN payload) beside low halves below, at and above the tie."""
    high = torch.arange(1 << 16, dtype=torch.int64)
    bits = ((high[:, None] << 16) | torch.tensor(_LOWS)[None, :]).reshape(-1)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32).view(torch.float32)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_every_bf16_pattern_class_round_trips_bit_exact(monkeypatch):
    monkeypatch.setattr(remainder, "capacity", lambda numel: numel)  # every pattern at once, NaNs and all
    master = _every_pattern()
    n = master.numel()
    bits = master.view(torch.int32)
    classes = {
        "+0": bits == 0,
        "-0": bits == -(1 << 31),
        "inf": master.isinf(),
        "nan": master.isnan(),
        "subnormal": (master != 0) & (master.abs() < torch.finfo(torch.float32).tiny) & ~master.isnan(),
        "tie": (bits & 0xFFFF) == 0x8000,
    }
    assert all(mask.any() for mask in classes.values())
    low = torch.empty(n, dtype=torch.int16)
    fixups = torch.zeros(remainder.fixup_bytes(n), dtype=torch.uint8)
    exceptions = remainder.encode(master, low, fixups, label="test")
    # Only what the rule cannot rebuild is listed: ties that rounded up (odd high halves)
    # and NaNs whose payload the cast dropped.
    assert exceptions < classes["tie"].sum() // 2 + classes["nan"].sum() + 1
    param = master.to(torch.bfloat16)
    rebuilt = torch.full_like(master, 7.0)
    reseeded = remainder.decode(rebuilt, low, fixups, [(0, param[:1000]), (1000, param[1000:])])
    assert int(reseeded) == 0
    for name, mask in classes.items():
        assert _same_bits(rebuilt[mask], master[mask]), name
    assert _same_bits(rebuilt, master)


def _rule_applied_whole(master: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The low halves and the fixup segment Note [remainder] defines, computed on the
    whole tensor in int64 (no pieces, no work tensors): what encode must write."""
    n = master.numel()
    bits = master.view(torch.int32).to(torch.int64)
    lo = bits & 0xFFFF
    high = master.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    rebuilt = ((high - (lo > 0x8000).to(torch.int64)) << 16) | lo
    wrong = ((rebuilt - bits) % (1 << 32)).nonzero().view(-1)
    fixups = torch.zeros(remainder.fixup_bytes(n), dtype=torch.uint8)
    fingerprints, count, indices, wrong_bits = remainder._fixup_views(fixups, n)
    fingerprints.copy_((high.view(-1, remainder.FINGERPRINT_BLOCK) * remainder._weights(master.device)).sum(dim=1))
    count.fill_(wrong.numel())
    indices[: wrong.numel()].copy_(wrong)
    wrong_bits[: wrong.numel()].copy_(master.view(torch.int32)[wrong])
    return master.view(torch.int16).view(-1, 2)[:, 0].clone(), fixups


@pytest.mark.parametrize("piece_blocks", [1, 3, 1 << 10])
def test_encode_and_decode_by_pieces_write_the_bytes_of_the_rule_applied_whole(monkeypatch, piece_blocks):
    monkeypatch.setattr(remainder, "capacity", lambda numel: numel)
    monkeypatch.setattr(remainder, "_PIECE", piece_blocks * remainder.FINGERPRINT_BLOCK)
    master = _every_pattern()
    n, block = master.numel(), remainder.FINGERPRINT_BLOCK
    expected_low, expected_fixups = _rule_applied_whole(master)
    low = torch.empty(n, dtype=torch.int16)
    fixups = torch.zeros(remainder.fixup_bytes(n), dtype=torch.uint8)
    remainder.encode(master, low, fixups, label="test")
    assert torch.equal(low, expected_low) and torch.equal(fixups, expected_fixups)
    # Decoded beside params of which one block changed: that block is the params' value,
    # every other element the master's exact bits.
    param = master.to(torch.bfloat16)
    param[5 * block + 1] = 2.0
    expected = master.clone()
    expected[5 * block : 6 * block] = param[5 * block : 6 * block].float()
    rebuilt = torch.full_like(master, 7.0)
    assert int(remainder.decode(rebuilt, low, fixups, [(0, param)])) == 1
    assert _same_bits(rebuilt, expected)


def test_a_bucket_of_trained_looking_masters_round_trips_through_its_file(disk_dir):
    gen = torch.Generator().manual_seed(0)
    master = torch.randn(50_000, generator=gen) * 0.02
    specials = _every_pattern()[::997][:40]  # a few of every class, within the default capacity
    master[1000 : 1000 + specials.numel()] = specials
    master[5000] = float("nan")
    master.view(torch.int32)[6000:6010] = (master.view(torch.int32)[6000:6010] & ~0xFFFF) | 0x8000  # ties
    param = master.to(torch.bfloat16)
    store = BucketStore(
        [Entry(name="w", shape=(50_000,), remainder=True)], disk_dir, bucket_numel=30_000, params=lambda i: param
    )
    store.initialize([master])
    states = store.stream()
    state = next(states)
    assert _same_bits(state.master, master)
    states.close()
    assert store.state_bytes < 50_000 * 10.1 + 3 * 4096 and store.layout()["master_layout"] == "remainder"
    store.close()


def test_masters_that_overflow_the_exception_list_are_refused_in_one_line(disk_dir):
    payload = torch.full((5000,), 0x7F81_0001, dtype=torch.int32).view(torch.float32)  # NaNs with a payload
    param = payload.to(torch.bfloat16)
    store = BucketStore([Entry(name="w", shape=(5000,), remainder=True)], disk_dir, params=lambda i: param)
    with pytest.raises(GreenroomError, match="not the bf16 param plus a 16-bit remainder") as e:
        store.initialize([payload])
    assert "\n" not in str(e.value) and "master_layout='fp32'" in str(e.value)
    store.close()


def test_remainder_steps_are_bit_identical_to_adamw_on_fp32_masters(disk_dir):
    ours, _ = twins(ODD_SHAPES, dtype=torch.bfloat16, seed=5)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    opt = StreamingAdam(ours, lr=1e-2, weight_decay=0.1, state_dir=disk_dir, bucket_numel=3000, resident_numel=0)
    assert all(b.remainder for b in opt.store.buckets)
    ref = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.1, foreach=True)
    for step in range(6):
        step_beside_fp32_masters(opt, ref, ours, masters, step=step)
    # state_dict() still exports whole fp32 masters in torch's format
    exported = opt.state_dict()["state"]
    for i, m in enumerate(masters):
        assert exported[i]["master"].dtype == torch.float32 and _same_bits(exported[i]["master"], m.detach())
        assert torch.equal(exported[i]["exp_avg"], ref.state[m]["exp_avg"])
    assert int(opt.store.reseeded_blocks) == 0
    opt.close()


def test_params_changed_from_outside_reseed_their_blocks_only(disk_dir):
    block = remainder.FINGERPRINT_BLOCK
    ours, _ = twins([(3 * block,), (500,)], dtype=torch.bfloat16, seed=9)
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    opt = StreamingAdam(ours, lr=1e-2, state_dir=disk_dir, resident_numel=0)
    ref = torch.optim.AdamW(masters, lr=1e-2, foreach=True)
    for step in range(2):
        step_beside_fp32_masters(opt, ref, ours, masters, step=step)
    # One element of the middle block, and the whole small param (an EMA-style swap).
    ours[0].data[block + 17] = 3.0
    swapped = torch.randn(500, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    ours[1].data.copy_(swapped)
    # What the step must start from: the middle block and the small param's block from
    # the params' values; the first and last blocks keep their masters' bits.
    masters[0].data[block : 2 * block] = ours[0].detach()[block : 2 * block].float()
    masters[1].data.copy_(swapped.float())
    step_beside_fp32_masters(opt, ref, ours, masters, step=2)
    assert int(opt.store.reseeded_blocks) == 2
    exported = opt.state_dict()["state"]
    for i, m in enumerate(masters):
        assert _same_bits(exported[i]["master"], m.detach())
    opt.close()


def test_a_checkpoint_of_one_master_layout_is_refused_by_the_other_in_one_line(disk_dir, tmp_path):
    ours, _ = twins([(1000,), (300,)], dtype=torch.bfloat16)
    opt = StreamingAdam(ours, state_dir=f"{disk_dir}/a", resident_numel=0)
    set_grads(ours, step=0)
    opt.step()
    opt.save_checkpoint(str(tmp_path / "ckpt"))
    whole = StreamingAdam(ours, state_dir=f"{disk_dir}/b", resident_numel=0, master_layout="fp32")
    with pytest.raises(CheckpointError, match="masters as remainder, this run as fp32") as e:
        whole.load_checkpoint(str(tmp_path / "ckpt"))
    assert "\n" not in str(e.value) and "master_layout='remainder'" in str(e.value)
    # The same layout loads back to the same masters.
    again = StreamingAdam(ours, state_dir=f"{disk_dir}/c", resident_numel=0)
    again.load_checkpoint(str(tmp_path / "ckpt"))
    saved, loaded = opt.state_dict()["state"], again.state_dict()["state"]
    for i in saved:
        assert _same_bits(saved[i]["master"], loaded[i]["master"])
    for o in (opt, whole, again):
        o.close()


def test_an_unknown_master_layout_is_a_one_line_error(disk_dir):
    with pytest.raises(ValueError, match="master_layout"):
        StreamingAdam(
            [torch.nn.Parameter(torch.zeros(10, dtype=torch.bfloat16))], state_dir=disk_dir, master_layout="fp16"
        )


def _beside_fp32_masters(tmp_path, *, device, compression, fused, steps=4):
    gen = torch.Generator().manual_seed(11)
    values = [torch.randn(s, generator=gen) * 0.02 for s in [(1024, 1024), (4099,), (333, 777)]]
    ours = [torch.nn.Parameter(v.to(device=device, dtype=torch.bfloat16)) for v in values]
    masters = [torch.nn.Parameter(p.detach().float().clone()) for p in ours]
    kernel = {"fused": True} if fused else {"foreach": True}
    ref = torch.optim.AdamW(masters, lr=1e-3, weight_decay=0.01, **kernel)
    opt = StreamingAdam(
        ours,
        lr=1e-3,
        weight_decay=0.01,
        state_dir=str(tmp_path / "optim"),
        bucket_numel=1 << 19,
        chunk_mb=8,
        resident_numel=0,
        compression=compression,
        **kernel,
    )
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 + step)
            for p, m in zip(ours, masters):
                grad = torch.randn(p.shape, generator=g).to(device)
                p.grad, m.grad = grad.to(torch.bfloat16), grad.to(torch.bfloat16).float()
            opt.step()
            ref.step()
            for p, m in zip(ours, masters):
                assert torch.equal(p.detach(), m.detach().to(torch.bfloat16))
        exported = opt.state_dict()["state"]
        for i, m in enumerate(masters):
            assert _same_bits(exported[i]["master"], m.detach().cpu())
            assert torch.equal(exported[i]["exp_avg_sq"], ref.state[m]["exp_avg_sq"].cpu())
        written = opt.store.disk_bytes("written"), opt.store.bytes_written
    finally:
        opt.close()
    return written


def test_remainder_with_a_codec_stays_bit_identical_and_the_low_halves_go_raw(tmp_path):
    disk, state = _beside_fp32_masters(tmp_path, device="cpu", compression="zstd", fused=False)
    assert disk < state  # the moments shrink; the low halves are stored as they are


@pytest.mark.gpu
@pytest.mark.parametrize("compression", ["none", "nvcomp-ans"])
def test_remainder_on_cuda_is_bit_identical_to_fused_adamw_on_fp32_masters(tmp_path, compression):
    from greenroom.io import compression as codecs

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if compression == "nvcomp-ans":
        try:
            codecs.resolve("nvcomp-ans", cuda=True, chunk_bytes=8 << 20)
        except Exception as e:  # nvCOMP not installed here
            pytest.skip(f"nvCOMP does not load: {e}")
    _beside_fp32_masters(tmp_path, device="cuda", compression=compression, fused=True)


def test_a_checkpoint_written_before_remainders_existed_still_loads(disk_dir, tmp_path):
    import json

    ours, _ = twins([(1000,), (300,)], dtype=torch.bfloat16)
    opt = StreamingAdam(ours, state_dir=f"{disk_dir}/a", resident_numel=0, master_layout="fp32")
    set_grads(ours, step=0)
    opt.step()
    path = str(tmp_path / "ckpt")
    opt.save_checkpoint(path)
    # The manifest as the previous version wrote it: no master layout, no remainder flags, no fixups.
    with open(f"{path}/manifest.json") as f:
        manifest = json.load(f)
    layout = manifest["layout"]
    del layout["master_layout"]
    for entry in layout["entries"]:
        del entry["remainder"]
    for bucket in layout["buckets"]:
        del bucket["segments"]["fixups"]
    with open(f"{path}/manifest.json", "w") as f:
        json.dump(manifest, f)
    again = StreamingAdam(ours, state_dir=f"{disk_dir}/b", resident_numel=0, master_layout="fp32")
    again.load_checkpoint(path)
    saved, loaded = opt.state_dict()["state"], again.state_dict()["state"]
    for i in saved:
        assert _same_bits(saved[i]["master"], loaded[i]["master"])
    for o in (opt, again):
        o.close()
