"""greenroom's own state outlives a failed wake (CPU, CI).

The portable offload backend with scope ``all`` moves every torch-owned storage gc can
reach (``greenroom.actor.discovery``), so a tensor greenroom cached in a module global or
a class attribute would belong to whichever actor sleeps next: moved out by the sleep,
and freed for good by a wake that failed and was not retried. The next use in the
process reads freed memory. That is how ``greenroom.optim.remainder``'s cached
fingerprint weights segfaulted two xdist workers. The rule since: greenroom keeps no
torch-owned tensor beyond a call in a module or a class (see discovery's docstring).
"""

import importlib
import os
import pkgutil
import subprocess
import sys

import torch

import greenroom
from greenroom import OffloadConfig, actor
from tests.actor.failed_wake_worker import stream_two_steps

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(REPO, "tests", "actor", "failed_wake_worker.py")


def test_streamed_steps_after_an_abandoned_failed_wake_are_bit_identical(disk_dir):
    """In a process of its own: a regression dies by SIGSEGV, which must fail this test
    rather than the test runner."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.join(REPO, "runtime"), REPO]))
    proc = subprocess.run([sys.executable, WORKER, disk_dir], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, f"rc {proc.returncode} (-11: a segfault)\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip().splitlines()[-1] == "identical: True", proc.stdout


def _greenroom_modules():
    for info in pkgutil.walk_packages(greenroom.__path__, "greenroom."):
        if info.name.endswith(".__main__"):
            continue  # runs the CLI on import
        try:
            yield importlib.import_module(info.name)
        except ImportError:  # an optional dependency (megatron-core) absent here
            continue


def _tensors_in(value, where: str, depth: int = 0):
    if isinstance(value, torch.Tensor):
        yield where, value
    elif depth < 4 and isinstance(value, dict):
        for k, v in list(value.items()):
            yield from _tensors_in(k, f"{where}[key {k!r}]", depth + 1)
            yield from _tensors_in(v, f"{where}[{k!r}]", depth + 1)
    elif depth < 4 and isinstance(value, (list, tuple, set, frozenset)):
        for i, v in enumerate(list(value)):
            yield from _tensors_in(v, f"{where}[{i}]", depth + 1)


def test_no_module_or_class_of_greenroom_keeps_a_tensor_the_offload_would_move(disk_dir):
    """After a streamed step (remainder encode and decode) and a sleep/wake that skips
    clean units (the actor's fingerprints): every tensor a greenroom module or class
    holds is one the portable backend leaves alone (not torch-owned, so never resized),
    and no function keeps a cache this walk cannot look into (functools.lru_cache)."""
    stream_two_steps(os.path.join(disk_dir, "opt"))
    model = torch.nn.Linear(256, 256)
    config = OffloadConfig(
        offload_train=True, offload_train_target="disk", offload_train_disk_dir=disk_dir, offload_train_disk_chunk_mb=1
    )
    with actor.build_offloader(config, os.path.join(disk_dir, "actor"), skip_clean=True).track(model) as off:
        for _ in range(2):
            with off.asleep():
                pass
    found, caches = [], []
    for module in _greenroom_modules():
        for name, value in list(vars(module).items()):
            where = f"{module.__name__}.{name}"
            if hasattr(value, "cache_info"):
                caches.append(where)
            found += _tensors_in(value, where)
            if isinstance(value, type) and value.__module__ == module.__name__:
                for attr, member in list(vars(value).items()):
                    found += _tensors_in(member, f"{where}.{attr}")
    moved = [where for where, t in found if t.untyped_storage().resizable()]
    assert not moved, f"greenroom keeps tensors the portable offload would move and may free: {moved}"
    assert not caches, f"greenroom caches results it cannot keep off the actor's memory: {caches}"
    assert any(where == "greenroom.io.integrity._LANES" for where, _ in found), "the walk saw no module tensor at all"
