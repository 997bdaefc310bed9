"""Complete by default: the portable backend moves what the trainer never tracked,
drops dead bytes, skips clean ones, and a failed wake can be tried again (CPU, CI)."""

import copy
import gc
import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from greenroom import OffloadConfig, actor
from greenroom.actor import tms
from greenroom.actor.movers import Moved
from greenroom.actor.offloader import LeftAsleep
from greenroom.dirs.rankdir import RankDir
from greenroom.errors import GreenroomError
from greenroom.io.engine import StateFile
from greenroom.train.model import ModelConfig, Transformer

RUNTIME = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "runtime")


def model_and_optimizer():
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=12, d_model=32, n_layers=2, n_heads=4, max_seq_len=10))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def step(model, optimizer, seed=0):
    tokens = torch.randint(0, 12, (4, 10), generator=torch.Generator().manual_seed(seed))
    optimizer.zero_grad(set_to_none=False)
    model(tokens).square().mean().backward()
    optimizer.step()


def offloader(rank_dir, target, **kw):
    config = OffloadConfig(
        offload_train=True,
        offload_train_target=target,
        offload_train_disk_dir=os.path.dirname(rank_dir.path),
        offload_train_disk_chunk_mb=1,
    )
    return actor.build_offloader(config, rank_dir, **kw)


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_untracked_state_of_several_kinds_survives_bit_exactly_and_is_freed(disk_dir, target):
    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    reference = copy.deepcopy(model).requires_grad_(False)  # a frozen reference policy
    ema = {n: p.detach().clone() for n, p in model.named_parameters()}  # an EMA copy, in a dict
    loose = [torch.randn(1000, dtype=torch.float64), torch.arange(33, dtype=torch.int16)]
    view = loose[0][10:20]  # a view: its storage moves once, the view stays valid
    foreign = torch.from_numpy(np.arange(64, dtype=np.float32))  # torch does not own it: stays resident
    untracked = [*reference.parameters(), *ema.values(), *loose, view, foreign]
    expected = [t.clone() for t in untracked]
    objects = [id(t) for t in untracked]
    with RankDir(disk_dir, job="u") as rank_dir, offloader(rank_dir, target) as off:
        off.track(model)  # a hint for the model only; nothing else is named
        for _ in range(3):
            with off.asleep():
                for t in untracked[:-2]:
                    assert t.untyped_storage().nbytes() == 0, "an untracked storage stayed resident"
                assert foreign.untyped_storage().nbytes() == 64 * 4
            assert [id(t) for t in untracked] == objects
            for t, e in zip(untracked, expected):
                assert torch.equal(t, e)
            assert view.data_ptr() == loose[0].data_ptr() + 10 * 8


def test_the_rollouts_allocations_never_move(disk_dir):
    with RankDir(disk_dir, job="r") as rank_dir, offloader(rank_dir, "cpu") as off:
        actor_state = torch.randn(256)
        with off.rollout_region():
            engine_weights = torch.randn(256)
        with off.asleep():
            assert actor_state.untyped_storage().nbytes() == 0
            assert engine_weights.untyped_storage().nbytes() == 256 * 4
            kv_cache = engine_weights * 2  # works while the actor sleeps
        assert torch.equal(kv_cache, engine_weights * 2)


def test_a_rollout_storage_stays_excluded_while_it_lives_whichever_of_its_tensors_die(disk_dir):
    """The exclusion is held by the storage, not by the last tensor seen on it: a view
    made after its base and dropped later must not take the base's exclusion along."""
    with RankDir(disk_dir, job="rv") as rank_dir, offloader(rank_dir, "cpu") as off:
        with off.rollout_region():
            engine = {"weights": torch.randn(256)}
            engine["head"] = engine["weights"][:16]  # a view the engine keeps for a while
        expected = engine["weights"].clone()
        del engine["head"]
        gc.collect()
        off.sleep()
        # Plain numbers in the asserts: a failure's message must not print a shrunk tensor.
        weight_bytes = engine["weights"].untyped_storage().nbytes()
        assert weight_bytes == 256 * 4, "the rollout's weights were shrunk"
        doubled = engine["weights"] * 2  # the rollout runs while the actor sleeps (expected is asleep)
        off.wake()
        assert torch.equal(engine["weights"], expected) and torch.equal(doubled, expected * 2)


def test_a_storage_the_rollout_allocates_where_it_freed_one_is_excluded(disk_dir):
    """ "New in the region" is decided by identity: a storage allocated inside the region
    at the address of one freed inside it is the rollout's too."""
    with RankDir(disk_dir, job="ra") as rank_dir, offloader(rank_dir, "cpu") as off:
        with off.rollout_region():
            engine = {"cache": torch.randn(256)}
        reused = 0
        for _ in range(3):
            with off.asleep():
                with off.rollout_region():  # the rollout refreshes its cache
                    for _ in range(100):  # until malloc puts the new storage where the old one was
                        freed = engine.pop("cache").untyped_storage()._cdata
                        engine["cache"] = torch.randn(256)
                        if engine["cache"].untyped_storage()._cdata == freed:
                            reused += 1
                            break
            expected = engine["cache"].clone()
            off.sleep()
            cache_bytes = engine["cache"].untyped_storage().nbytes()  # a number: a failure must not print it
            assert cache_bytes == 256 * 4, "the rollout's cache was shrunk"
            off.wake()
            assert torch.equal(engine["cache"], expected)
        assert reused, "no storage took a freed one's address: the case was not exercised"


def test_storages_in_shared_memory_stay_resident_intact_and_are_reported(disk_dir):
    """model.share_memory() (Hogwild, worker processes) and a DataLoader worker's batch:
    other processes map them, so the sleep leaves them as they are and says how many
    bytes it left; torch could not grow a shrunk shared storage back."""
    model = torch.nn.Linear(64, 64)
    model.share_memory()
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(64, 8)), batch_size=16, num_workers=1
    )
    (batch,) = next(iter(loader))
    assert batch.is_shared() and model.weight.is_shared()
    shared = [model.weight, model.bias, batch]
    expected = [t.detach().clone() for t in shared]
    with RankDir(disk_dir, job="sh") as rank_dir, offloader(rank_dir, "cpu") as off:
        off.track(model)
        for _ in range(2):
            slept = off.sleep()
            sizes = [t.untyped_storage().nbytes() for t in shared]
            assert sizes == [t.nbytes for t in expected]
            assert slept.left_resident >= sum(t.nbytes for t in expected)
            off.wake()
            assert all(torch.equal(t, e) for t, e in zip(shared, expected))


def test_two_cpu_target_offloaders_in_one_process_leave_each_others_host_copies_alone():
    """B's sleep scans every CPU storage; A's host copies (A's sleeping actor) must not
    be among them. In a process of its own: a failure here is a segfault at A.wake()."""
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            textwrap.dedent("""
        import tempfile, torch
        from greenroom import OffloadConfig, actor
        from greenroom.dirs.rankdir import RankDir
        root = tempfile.mkdtemp()
        config = OffloadConfig(offload_train=True, offload_train_target="cpu", offload_train_disk_dir=root)
        with RankDir(root, job="actor") as ra, RankDir(root, job="critic") as rc, \
                actor.build_offloader(config, ra) as a, actor.build_offloader(config, rc) as b:
            actor_state = torch.randn(1 << 16)
            expected = actor_state.clone()
            a.sleep()
            b.sleep()
            a.wake()
            b.wake()
            print("identical:", torch.equal(actor_state, expected))
    """),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": RUNTIME},
    )
    assert child.returncode == 0, f"rc {child.returncode} (-11: a segfault)\n{child.stderr[-2000:]}"
    assert child.stdout.strip().splitlines()[-1] == "identical: True"


def test_a_tracked_sparse_grad_stays_resident_as_the_scan_leaves_it(disk_dir):
    """nn.Embedding(sparse=True): its grad has no storage of its own to shrink (its
    indices and values are tensors only C++ holds); tracking skips it like the scan."""
    model = torch.nn.Embedding(100, 8, sparse=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.tensor([1, 2, 3])).sum().backward()
    optimizer.step()  # the step-end hook reads the sparse grad too
    grad = model.weight.grad
    expected_weight, expected_grad = model.weight.detach().clone(), grad.clone()
    with RankDir(disk_dir, job="sp") as rank_dir, offloader(rank_dir, "disk") as off:
        off.track(model, optimizer)
        with off.asleep():
            assert model.weight.untyped_storage().nbytes() == 0  # the dense weight moves
        assert torch.equal(model.weight, expected_weight)
        assert model.weight.grad is grad
        assert torch.equal(grad._indices(), expected_grad._indices())
        assert torch.equal(grad._values(), expected_grad._values())


def test_what_the_portable_backend_cannot_see_is_said_once(disk_dir, caplog):
    with RankDir(disk_dir, job="w") as rank_dir, offloader(rank_dir, "cpu") as off:
        with caplog.at_level(logging.WARNING, logger="greenroom"):
            for _ in range(3):
                off.sleep()
                off.wake()
    said = [r.getMessage() for r in caplog.records if "portable backend" in r.getMessage()]
    assert len(said) == 1
    assert "autograd" in said[0] and "\n" not in said[0]


@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_grads_consumed_by_the_step_are_dropped_and_come_back_zero(disk_dir, target):
    with RankDir(disk_dir, job="g") as rank_dir, offloader(rank_dir, target) as off:
        model, optimizer = model_and_optimizer()
        step(model, optimizer)  # the offloader sees every optimizer step from its creation on
        grads = [p.grad for p in model.parameters()]
        grad_bytes = sum(g.nbytes for g in grads)
        params = [p.detach().clone() for p in model.parameters()]
        slept = off.sleep()
        off.wake()
        assert slept.dead >= grad_bytes
        assert all(not g.any() for g in grads), "a consumed grad came back non-zero"
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), params))
        # A sleep between backward and step: the grads are still needed and move.
        model(torch.randint(0, 12, (4, 10))).square().mean().backward()
        live = [g.clone() for g in grads]
        slept = off.sleep()
        off.wake()
        assert slept.dead < grad_bytes
        assert all(torch.equal(g, e) for g, e in zip(grads, live))
        # Accumulation across the phase: step, then one more micro-batch's backward.
        optimizer.step()
        model(torch.randint(0, 12, (4, 10))).square().mean().backward()
        accumulated = [g.clone() for g in grads]
        off.sleep()
        off.wake()
        assert all(torch.equal(g, e) for g, e in zip(grads, accumulated))


def test_a_grad_written_without_a_version_bump_after_the_step_comes_back_zero(disk_dir):
    """The dead-grad rule's known limit, as docs/offload.md states it: a write through
    ``.data`` after the step bumps no counter the rule sees, so the grad is dropped;
    ``increment_version`` after such a write makes it move."""
    with RankDir(disk_dir, job="v") as rank_dir, offloader(rank_dir, "cpu") as off:
        p = torch.nn.Parameter(torch.randn(1000))
        optimizer = torch.optim.SGD([p], lr=0.1)
        p.grad = torch.randn(1000)
        optimizer.step()
        p.grad.data.add_(1.0)
        off.sleep()
        off.wake()
        assert not p.grad.any()
        optimizer.step()
        p.grad.data.copy_(torch.arange(1000.0))
        torch.autograd.graph.increment_version(p.grad)
        expected = p.grad.clone()
        off.sleep()
        off.wake()
        assert torch.equal(p.grad, expected)


def test_bucket_grads_are_dead_only_when_the_step_read_the_whole_bucket(disk_dir):
    """Grads as views into one flat buffer (DDP's gradient_as_bucket_view)."""
    a, b = torch.nn.Parameter(torch.randn(100)), torch.nn.Parameter(torch.randn(50))
    bucket = torch.randn(150)
    a.grad, b.grad = bucket[:100], bucket[100:]
    with RankDir(disk_dir, job="b") as rank_dir, offloader(rank_dir, "disk") as off:
        torch.optim.SGD([a], lr=0.1).step()  # reads half the bucket: the bucket is live
        before = bucket.clone()
        off.sleep()
        off.wake()
        assert torch.equal(bucket, before)
        torch.optim.SGD([a, b], lr=0.1).step()  # the whole bucket consumed
        off.sleep()
        off.wake()
        assert not bucket.any()


def test_discarded_tensors_are_not_moved_and_come_back_zero(disk_dir):
    scratch = torch.randn(1 << 16)
    kept = torch.randn(1 << 16)
    expected = kept.clone()
    with RankDir(disk_dir, job="d") as rank_dir, offloader(rank_dir, "disk") as off:
        off.discard(scratch)
        slept = off.sleep()
        off.wake()
        assert slept.dead >= scratch.nbytes
        assert not scratch.any() and torch.equal(kept, expected)
        scratch.fill_(1.0)  # a discard holds for one sleep only
        off.sleep()
        off.wake()
        assert bool((scratch == 1.0).all())
        with pytest.raises(ValueError, match="whole storage"):
            off.discard(kept[1:])


def test_a_changed_byte_in_a_large_block_is_rewritten_and_an_unchanged_block_is_not(disk_dir):
    block = torch.randint(0, 256, (64 << 20,), dtype=torch.uint8)  # 64 MiB
    with RankDir(disk_dir, job="c") as rank_dir, offloader(rank_dir, "disk", scope="tracked", skip_clean=True) as off:
        off.track(block)
        first = off.sleep()
        off.wake()
        assert first.copied == block.numel() and first.clean == 0
        second = off.sleep()  # nothing changed: the file already holds these bytes
        off.wake()
        assert second.copied == 0 and second.clean == block.numel()
        block[12_345_678] ^= 1  # one byte
        expected = block.clone()
        third = off.sleep()
        off.wake()
        assert third.copied == block.numel()
        assert torch.equal(block, expected)


def test_a_failed_wake_stays_asleep_and_can_be_retried_with_the_files_intact(disk_dir, monkeypatch):
    state = torch.randn(1 << 18)
    expected = state.clone()
    with RankDir(disk_dir, job="f") as rank_dir, offloader(rank_dir, "disk", scope="tracked") as off:
        off.track(state)
        off.sleep()
        real_read = StateFile.read

        def failing_read(self, buf, offset):
            raise OSError(5, "Input/output error (injected)")

        monkeypatch.setattr(StateFile, "read", failing_read)
        with pytest.raises(OSError, match="injected"):
            off.wake()
        assert off.is_asleep
        assert os.listdir(os.path.join(rank_dir.path, "offload")) == ["actor.state"]
        monkeypatch.setattr(StateFile, "read", real_read)
        off.wake()
        assert not off.is_asleep and torch.equal(state, expected)


def test_memory_torch_did_not_allocate_in_the_paused_region_is_refused_in_one_line():
    tms.check_release(released=1 << 30, expected=1 << 30)  # what the GPU machine showed: exact
    with pytest.raises(GreenroomError, match="did not allocate") as err:
        tms.check_release(released=(1 << 30) + (256 << 20), expected=1 << 30)
    assert "\n" not in str(err.value) and "256 MiB" in str(err.value)
    tms.check_release(released=1 << 30, expected=(1 << 30) + (64 << 20))  # segments outside the hook: fine


class _FakeSaver:
    """torch_memory_saver's pause and resume of a region of ``held`` bytes, on a device whose
    free memory (``free``) also moves by ``elsewhere[k]`` during the k-th pause (another
    process, a library's thread), with failures where ``fail`` puts them, keyed by call and
    its count. The real one needs CUDA and runs in tests/actor/test_gpu.py."""

    def __init__(self, held: int, elsewhere: list[int] = (), fail: dict | None = None) -> None:
        self.held, self.elsewhere, self.fail, self.free, self.calls = held, list(elsewhere), fail or {}, 0, []

    def _call(self, name: str) -> int:
        self.calls.append(name)
        count = self.calls.count(name)
        error = self.fail.get((name, count))
        if error is not None:
            raise error
        return count

    def pause(self, tag=None) -> None:
        k = self._call("pause") - 1
        self.free += self.held + (self.elsewhere[k] if k < len(self.elsewhere) else 0)

    def resume(self, tag=None) -> None:
        self._call("resume")
        self.free -= self.held


@pytest.mark.parametrize(
    "elsewhere, foreign, pauses",
    [
        ([0], 0, 1),  # alone on the device: one pause
        ([2 << 20, 0], 0, 2),  # freed elsewhere during the first pause only
        ([2 << 20, 4 << 20, 0], 0, 3),
        ([2 << 20] * 3, 2 << 20, 3),  # a foreign allocation shows at every pause
        ([-(8 << 20), 0], -(8 << 20), 1),  # allocated elsewhere: under the slack, no refusal
    ],
)
def test_a_pause_that_released_more_than_torch_held_is_measured_again(elsewhere, foreign, pauses):
    expected = 1 << 30
    saver = _FakeSaver(expected, elsewhere)
    released = tms.released_by_pause(saver.pause, saver.resume, lambda: saver.free, expected)
    assert released - expected == foreign
    assert saver.calls == ["pause", "resume"] * (pauses - 1) + ["pause"]  # left paused, each pause measured


class _FakeMover:
    def __init__(self) -> None:
        self.restored = 0

    def save(self, units):
        return Moved(copied=1)

    def restore(self, units):
        self.restored += 1
        return Moved(copied=1)


def _tms_offloader(monkeypatch, saver, free_bytes):
    """A TmsOffloader's sleep on the CPU: the saver and the driver's free memory are stand-ins."""
    off = object.__new__(tms.TmsOffloader)
    off._tms, off._mover, off.device = saver, _FakeMover(), torch.device("cpu")
    off._paused = off._given_back = False
    off.pause_seconds = off.resume_seconds = 0.0
    monkeypatch.setattr(off, "_actor_segment_bytes", lambda: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free_bytes(), 0))
    return off


@pytest.mark.parametrize(
    "elsewhere, fail, interrupted_read, raised, calls",
    [
        # the first pause fails: the device still holds every byte, nothing to put back
        ([], {("pause", 1): RuntimeError("pause")}, None, RuntimeError, ["pause"]),
        # a signal once the pause gave the bytes back: resumed and restored, then raised
        ([], {}, 2, KeyboardInterrupt, ["pause", "resume"]),
        # the pause taken again fails after its resume: restored, then raised
        ([4 << 20], {("pause", 2): RuntimeError("pause")}, None, RuntimeError, ["pause", "resume", "pause"]),
    ],
)
def test_a_sleep_stopped_after_its_pause_puts_the_actor_back(
    monkeypatch, elsewhere, fail, interrupted_read, raised, calls
):
    saver, reads = _FakeSaver(0, elsewhere, fail), []

    def free_bytes():
        reads.append(1)
        if len(reads) == interrupted_read:
            raise KeyboardInterrupt
        return saver.free

    off = _tms_offloader(monkeypatch, saver, free_bytes)
    with pytest.raises(raised):
        off._sleep([])
    assert saver.calls == calls
    assert off._mover.restored == (0 if calls == ["pause"] else 1) and not off._paused


def test_a_sleep_whose_undo_fails_is_left_asleep_in_one_line(monkeypatch):
    # Every pause reads 64 MiB more than torch held; the two re-measures' resumes work, the put-back's fails.
    saver = _FakeSaver(0, [64 << 20] * 3, {("resume", 3): RuntimeError("no device memory")})
    off = _tms_offloader(monkeypatch, saver, lambda: saver.free)
    with pytest.raises(
        LeftAsleep,
        match="did not allocate.*putting the actor back then failed "
        r"\(RuntimeError: no device memory\)",
    ) as err:
        off._sleep([])
    assert "\n" not in str(err.value) and off._paused and off._mover.restored == 0
    assert saver.calls == ["pause", "resume", "pause", "resume", "pause", "resume"]


def test_all_zero_storages_are_not_moved_and_come_back_identical(disk_dir):
    """Grads zeroed in place after the step (zero_grad(set_to_none=False)) and any
    all-zero buffer: zero-filling at wake gives the same bytes, so nothing moves."""
    with RankDir(disk_dir, job="z") as rank_dir, offloader(rank_dir, "disk") as off:
        model, optimizer = model_and_optimizer()
        step(model, optimizer)
        optimizer.zero_grad(set_to_none=False)  # written after the step: not "consumed", but zero
        zeros = torch.zeros(1 << 16)
        almost = torch.zeros(1 << 16)
        almost[-1] = 1.0
        grads = [p.grad for p in model.parameters()]
        slept = off.sleep()
        off.wake()
        assert slept.dead >= sum(g.nbytes for g in grads) + zeros.nbytes
        assert all(not g.any() for g in grads) and not zeros.any()
        assert almost[-1] == 1.0 and not almost[:-1].any()


def test_sleep_and_wake_out_of_order_are_one_line_errors(disk_dir):
    from greenroom.errors import GreenroomError

    with RankDir(disk_dir, job="o") as rank_dir, offloader(rank_dir, "cpu") as off:
        with pytest.raises(GreenroomError, match=r"wake\(\) while awake"):
            off.wake()
        off.sleep()
        with pytest.raises(GreenroomError, match=r"sleep\(\) while asleep"):
            off.sleep()
        off.wake()


def test_a_tracked_streaming_optimizer_gives_back_its_buffers_before_the_sleep(disk_dir):
    from greenroom.optim import StreamingAdam

    with RankDir(disk_dir, job="s") as rank_dir, offloader(rank_dir, "disk") as off:
        model = torch.nn.Linear(512, 512).to(torch.bfloat16)
        opt = StreamingAdam(model.parameters(), state_dir=rank_dir, bucket_numel=100_000, chunk_mb=1)
        model(torch.randn(4, 512, dtype=torch.bfloat16)).float().sum().backward()
        opt.step()
        assert opt.device_bytes() > 0
        off.track(model, opt)
        before = [p.detach().clone() for p in model.parameters()]
        with off.asleep():
            assert opt.device_bytes() == 0  # given back, not moved
        opt.step()  # makes its buffers again
        assert opt.device_bytes() > 0
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        opt.close()


def test_a_sleep_whose_undo_failed_leaves_the_actor_asleep_and_wake_restores_it(disk_dir):
    """The tms backend undoes a refused pause with a wake; when that wake failed too (an
    I/O error restoring), the offloader must not say the actor is awake "as it was" with
    its tensors partly restored: the backend raises ``LeftAsleep``, the offloader is
    asleep and ``wake()`` brings every byte back. The refusal is stood in for on the
    portable backend (the tms backend needs CUDA): the real sleep runs, then it raises."""
    from greenroom.actor.offloader import LeftAsleep

    model, optimizer = model_and_optimizer()
    step(model, optimizer)
    expected = [p.detach().clone() for p in model.parameters()]
    with RankDir(disk_dir, job="u") as rank_dir, offloader(rank_dir, "disk") as off:
        off.track(model)
        real = off._sleep

        def undo_failed(units):
            real(units)
            raise LeftAsleep("stand-in: the pause was refused; putting the actor back then failed: call wake()")

        off._sleep = undo_failed
        with pytest.raises(LeftAsleep):
            off.sleep()
        assert off.is_asleep
        off._sleep = real
        off.wake()
        assert all(torch.equal(p, e) for p, e in zip(model.parameters(), expected))
