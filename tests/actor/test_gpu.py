"""Actor offload on CUDA (GPU machine only: ``pytest -m gpu``).

Each case starts a fresh actor process (with ``launch_env``'s environment for
torch_memory_saver, whose hook must be preloaded at start), trains a real model on
CUDA, then sleeps and wakes it three times: every param, grad, buffer and AdamW state
tensor, and what the trainer never tracked (a frozen reference policy, an EMA copy, a
loose tensor), must come back bit-identical (at the same device address on
torch_memory_saver), and the device memory must be free while the actor sleeps. Then:
a second process allocates the memory the portable backend gave back; an NCCL process
group works after every wake; memory torch did not allocate is refused in one line,
and memory freed elsewhere on the device during a pause is measured again, not refused.
"""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from greenroom import OffloadConfig, actor

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (runs on the GPU machine)"),
]


def _child_env(extra: dict) -> dict:
    """This environment plus ``extra``, with this checkout's runtime first on PYTHONPATH."""
    return {
        **os.environ,
        **extra,
        "PYTHONPATH": os.pathsep.join([os.path.join(REPO, "runtime"), os.environ.get("PYTHONPATH", "")]),
    }


def _run(code: str, env_extra: dict, timeout: int = 300) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=_child_env(env_extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout.strip()


# What every child script imports.
IMPORTS = """
import copy, os, sys, torch
from greenroom import OffloadConfig, actor
from greenroom.errors import GreenroomError
from greenroom.dirs.rankdir import RankDir
from greenroom.train.model import ModelConfig, Transformer
"""

CHILD = (
    IMPORTS
    + """config = OffloadConfig(offload_train=True, offload_train_target={target!r},
                       offload_train_disk_dir={disk_dir!r},
                       offload_train_disk_chunk_mb=16)
with RankDir({disk_dir!r}, role="actor") as rd, actor.build_offloader(config, rd, device="cuda",
                                                                        backend="tms") as off:
    assert off.backend == "tms" and off.mover == {mover!r}
    torch.manual_seed(0)
    model = Transformer(ModelConfig(vocab_size=512, d_model=1024, n_layers=4, n_heads=8, max_seq_len=64)).cuda()
    model.register_buffer("counter", torch.arange(7, device="cuda"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    tokens = torch.randint(0, 512, (4, 64), device="cuda")
    for _ in range(2):
        optimizer.zero_grad(set_to_none=False)
        model(tokens).float().square().mean().backward()
        optimizer.step()
    off.track(model, optimizer)
    tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
               *(v for s in optimizer.state.values() for v in s.values() if v.is_cuda)]
    # The greenroom mover drops the grads the step consumed (they come back zero-filled);
    # torch_memory_saver's own mover moves the whole region, grads included.
    consumed = {{id(p.grad) for p in model.parameters()}} if {mover!r} == "greenroom" else set()
    before = [torch.zeros_like(t).cpu() if id(t) in consumed else t.detach().cpu().clone() for t in tensors]
    addresses = [t.data_ptr() for t in tensors]
    actor_bytes = sum(t.nbytes for t in off.tracked())
    for cycle in range(3):
        torch.cuda.synchronize()
        free_awake = torch.cuda.mem_get_info()[0]
        with off.asleep():
            with off.rollout_region():
                scratch = torch.full((1 << 20,), 3.0, device="cuda")  # the rollout's memory
            freed = torch.cuda.mem_get_info()[0] - free_awake + scratch.nbytes
            assert freed >= 0.9 * actor_bytes, (freed, actor_bytes)
            if {target!r} == "disk":
                assert os.listdir(os.path.join(rd.path, "offload")), "nothing in the rank's offload dir"
        assert [t.data_ptr() for t in tensors] == addresses, "addresses changed"
        for b, t in zip(before, tensors):
            assert torch.equal(b, t.detach().cpu()), "not bit-exact"
        del scratch
    optimizer.zero_grad(set_to_none=False)
    model(tokens).float().square().mean().backward()
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
print("ok", off.last_sleep.nbytes, round(off.last_sleep.seconds, 3), round(off.last_wake.seconds, 3))
"""
)


@pytest.mark.parametrize("mover", ["greenroom", "tms"])
@pytest.mark.parametrize("target", ["cpu", "disk"])
def test_tms_sleep_wake_is_bit_exact_at_the_same_addresses(disk_dir, target, mover):
    config = OffloadConfig(
        offload_train=True, offload_train_target=target, offload_train_disk_dir=disk_dir, offload_train_disk_chunk_mb=16
    )
    out = _run(
        CHILD.format(target=target, mover=mover, disk_dir=disk_dir),
        actor.launch_env(config, 0, job=f"gpu-{target}-{mover}", mover=mover),
    )
    print(target, mover, out)
    assert os.listdir(disk_dir) == []


def test_greenroom_train_on_cuda_relaunches_under_the_hook_and_learns(disk_dir):
    metrics = os.path.join(disk_dir, "m.jsonl")
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "greenroom.cli.main",
            "train",
            "--offload-train",
            "--offload-train-target",
            "disk",
            "--offload-train-disk-dir",
            os.path.join(disk_dir, "offload"),
            "--iterations",
            "4",
            "--no-progress",
            "--metrics",
            metrics,
        ],
        env=_child_env({}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "(tms)" in result.stdout
    assert len(open(metrics).readlines()) == 4
    assert os.listdir(os.path.join(disk_dir, "offload")) == []


def _env(backend: str, target: str, disk_dir: str, job: str) -> dict:
    if backend != "tms":
        return {}
    config = OffloadConfig(offload_train=True, offload_train_target=target, offload_train_disk_dir=disk_dir)
    return actor.launch_env(config, 0, job=job)


PREAMBLE = (
    IMPORTS
    + """config = OffloadConfig(offload_train=True, offload_train_target={target!r},
                       offload_train_disk_dir={disk_dir!r},
                       offload_train_disk_chunk_mb=64)
rd = RankDir({disk_dir!r}, role="actor").open()
off = actor.build_offloader(config, rd, device="cuda", backend={backend!r})
"""
)

COMPLETE = (
    PREAMBLE
    + """
torch.manual_seed(0)
model = Transformer(ModelConfig(vocab_size=512, d_model=1024, n_layers=4, n_heads=8, max_seq_len=64)).cuda()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
tokens = torch.randint(0, 512, (4, 64), device="cuda")
for _ in range(2):
    optimizer.zero_grad(set_to_none=False)
    model(tokens).float().square().mean().backward()
    optimizer.step()
model(tokens).float().square().mean().backward()  # live grads: the step has not run
reference = copy.deepcopy(model).requires_grad_(False)   # nothing below is tracked
ema = {{n: p.detach().clone() for n, p in model.named_parameters()}}
loose = torch.randn(3 << 20, device="cuda", dtype=torch.float64)
tensors = [*model.parameters(), *(p.grad for p in model.parameters()), *model.buffers(),
           *(v for s in optimizer.state.values() for v in s.values() if v.is_cuda),
           *reference.parameters(), *ema.values(), loose]
before = [t.detach().cpu().clone() for t in tensors]
addresses = [t.data_ptr() for t in tensors]
objects = [id(t) for t in tensors]
actor_bytes = sum({{t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}}.values())
for cycle in range(3):
    torch.cuda.synchronize()
    free_awake = torch.cuda.mem_get_info()[0]
    with off.asleep():
        freed = torch.cuda.mem_get_info()[0] - free_awake
        assert freed >= 0.9 * actor_bytes, (freed, actor_bytes)
    if off.backend == "tms":
        assert [t.data_ptr() for t in tensors] == addresses, "addresses changed"
    assert [id(t) for t in tensors] == objects
    for i, (b, t) in enumerate(zip(before, tensors)):
        assert torch.equal(b, t.detach().cpu()), f"tensor {{i}} not bit-exact"
    s = off.last_sleep
    print("cycle", cycle, "covered", s.nbytes, "copied", s.copied, "clean", s.clean, "dead", s.dead,
          "release", getattr(off, "last_release", None))
optimizer.step()
optimizer.zero_grad(set_to_none=False)
model(tokens).float().square().mean().backward()
optimizer.step()
assert all(torch.isfinite(p).all() for p in model.parameters())
off.close(); rd.close()
print("ok", actor_bytes)
"""
)


@pytest.mark.parametrize("target", ["cpu", "disk"])
@pytest.mark.parametrize("backend", ["tms", "portable"])
def test_untracked_state_comes_back_bit_exact_by_default(disk_dir, backend, target):
    out = _run(
        COMPLETE.format(target=target, disk_dir=disk_dir, backend=backend),
        _env(backend, target, disk_dir, f"complete-{backend}-{target}"),
    )
    print(backend, target, out)
    assert out.endswith(tuple("0123456789")) and "ok" in out
    assert os.listdir(disk_dir) == []


SECOND_PROCESS = (
    PREAMBLE
    + """
import subprocess
GIB = 1 << 30
state = [torch.randint(0, 256, (GIB,), dtype=torch.uint8, device="cuda") for _ in range(3)]
expected = [s.cpu() for s in state]
torch.cuda.synchronize()
with off.rollout_region():  # the rollout's own memory: leaves about 1 GiB free
    filler = torch.empty(torch.cuda.mem_get_info()[0] - GIB, dtype=torch.uint8, device="cuda")
probe = [sys.executable, "-c", "import torch; x = torch.full((5 << 29,), 7, dtype=torch.uint8, device='cuda'); "
         "torch.cuda.synchronize(); print(int(x[-1]), torch.cuda.mem_get_info()[0])"]
awake = subprocess.run(probe, capture_output=True, text=True)
assert awake.returncode != 0, "2.5 GiB fitted beside the awake actor: the filler did not fill"
with off.asleep():
    print("free while asleep", torch.cuda.mem_get_info()[0])
    asleep = subprocess.run(probe, capture_output=True, text=True)
    assert asleep.returncode == 0, asleep.stderr[-2000:]
    print("second process:", asleep.stdout.strip())
for s, e in zip(state, expected):
    assert torch.equal(s.cpu(), e)
off.close(); rd.close()
print("ok")
"""
)


def test_a_second_process_allocates_what_the_portable_backend_gave_back(disk_dir):
    out = _run(SECOND_PROCESS.format(target="disk", disk_dir=disk_dir, backend="portable"), {})
    print(out)
    assert out.endswith("ok")


NCCL = (
    PREAMBLE
    + """
import socket
import torch.distributed as dist
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
with off.outside_region() if {outside} else __import__("contextlib").nullcontext():
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{{port}}", rank=0, world_size=1,
                            device_id=torch.device("cuda", 0))
    warm = torch.ones(1 << 20, device="cuda")
    dist.all_reduce(warm)  # the communicator and its buffers exist before the first sleep
state = torch.randn(1 << 24, device="cuda")
expected = state.cpu()
for cycle in range(3):
    with off.asleep():
        pass
    x = torch.full((1 << 20,), float(cycle + 1), device="cuda")
    dist.all_reduce(x)
    dist.broadcast(x, src=0)
    torch.cuda.synchronize()
    assert bool((x == cycle + 1).all()), f"collective after wake {{cycle}} gave {{x[:4]}}"
    assert torch.equal(state.cpu(), expected)
    print("cycle", cycle, "release", getattr(off, "last_release", None))
dist.destroy_process_group()
off.close(); rd.close()
print("ok")
"""
)


@pytest.mark.parametrize("cumem", ["default", "off-outside-region"])
def test_an_nccl_process_group_works_after_every_wake(disk_dir, cumem):
    env = _env("tms", "disk", disk_dir, f"nccl-{cumem}")
    if cumem != "default":
        env["NCCL_CUMEM_ENABLE"] = "0"
    out = _run(NCCL.format(target="disk", disk_dir=disk_dir, backend="tms", outside=cumem != "default"), env)
    print(cumem, out)
    assert out.endswith("ok")


FOREIGN = (
    PREAMBLE
    + """
import ctypes
state = torch.randn(1 << 24, device="cuda")
expected = state.cpu()
pointer = ctypes.c_void_p()
# The preloaded hook's cudaMalloc, as a library calling the runtime itself would reach it.
assert ctypes.CDLL(None).cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(256 << 20)) == 0
try:
    off.sleep()
except GreenroomError as e:
    message = str(e)
else:
    raise SystemExit("a sleep with 256 MiB of foreign memory in the region was not refused")
assert "did not allocate" in message and "\\n" not in message, message
assert not off.is_asleep and torch.equal(state.cpu(), expected)
print(message)
off.close(); rd.close()
print("ok")
"""
)


TRANSIENT = (
    PREAMBLE
    + """
import ctypes
state = torch.randn(1 << 24, device="cuda")
expected = state.cpu()
cudart = ctypes.CDLL(None)
elsewhere = ctypes.c_void_p()
with off.outside_region():  # not in the paused region, as another process's memory is not
    assert cudart.cudaMalloc(ctypes.byref(elsewhere), ctypes.c_size_t(64 << 20)) == 0
real_pause, pauses = off._tms.pause, []


def pause_while_memory_is_freed_elsewhere(tag):
    real_pause(tag)
    pauses.append(tag)
    if elsewhere.value:  # during the first pause only: the driver's free memory grows by 64 MiB more
        assert cudart.cudaFree(elsewhere) == 0
        elsewhere.value = None


off._tms.pause = pause_while_memory_is_freed_elsewhere
with off.asleep():
    released, held = off.last_release
    assert len(pauses) == 2 and released - held <= (1 << 20), (pauses, off.last_release)
assert torch.equal(state.cpu(), expected)
print("pauses", len(pauses), "release", off.last_release)
off.close(); rd.close()
print("ok")
"""
)


def test_memory_freed_elsewhere_during_the_pause_is_measured_again_not_refused(disk_dir):
    out = _run(
        TRANSIENT.format(target="disk", disk_dir=disk_dir, backend="tms"), _env("tms", "disk", disk_dir, "transient")
    )
    print(out)
    assert out.endswith("ok")


def test_memory_torch_did_not_allocate_is_refused_and_the_actor_stays_awake(disk_dir):
    out = _run(
        FOREIGN.format(target="disk", disk_dir=disk_dir, backend="tms"), _env("tms", "disk", disk_dir, "foreign")
    )
    print(out)
    assert out.endswith("ok")
