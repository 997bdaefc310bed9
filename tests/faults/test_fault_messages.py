"""Messages after a fault: each says what happened and what to do. Real processes and
files; the full disk is a small tmpfs (root only), the reclaimer a real ``greenroom
reclaim`` stopped at a named point (``GREENROOM_TEST_STOP_AT``) while it holds the dead
run's lock.

The chunk-size message is in tests/io/test_compression.py (its reader/writer test), the
metrics of a killed and resumed run in tests/faults/test_save_faults.py.
"""

import json
import logging
import os
import re
import signal

import pytest
import torch

from greenroom.errors import IntegrityError
from greenroom.optim import StreamingAdam
from tests.cli_support import greenroom, greenroom_stopped_at, one_line_error
from tests.dirs.test_reclaim import dead_owner
from tests.train.test_faults import full_fs  # noqa: F401 (a fixture)

TRAIN = [
    "train",
    "--offload-train",
    "--offload-train-target",
    "disk",
    "--iterations",
    "1",
    "--prompts",
    "4",
    "--group-size",
    "2",
    "--minibatches",
    "1",
    "--d-model",
    "16",
    "--no-progress",
]


def test_a_disk_dir_on_a_full_filesystem_is_one_line_naming_the_path(full_fs, tmp_path):  # noqa: F811
    """Setting up the rank dir on a full filesystem fails in one line, not an OSError traceback."""
    with open(os.path.join(full_fs, "fill"), "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass
    root = os.path.join(full_fs, "offload")
    proc = greenroom(
        *TRAIN,
        "--offload-train-disk-dir",
        root,
        "--allow-tmpfs",
        "--metrics",
        str(tmp_path / "m.jsonl"),
        env={"GREENROOM_JOB_ID": "j"},
    )
    line = one_line_error(proc)
    assert re.search(
        rf"setting up this rank's dir {re.escape(root)}/j/actor/rank00000 failed: No space left on "
        r"device \(ENOSPC\); free space there or point --offload-train-disk-dir at another disk",
        line,
    ), line
    assert not os.path.exists(os.path.join(root, "j")), "the half-made rank dir stays"


def test_a_rank_dir_a_reclaimer_is_deleting_is_not_blamed_on_its_dead_owner(disk_dir, tmp_path):
    """It said "held by a live process (pid N ...)", N the dead trainer, with a --rank hint
    that ``greenroom train`` does not have."""
    dead = dead_owner(disk_dir, job="j")
    owner = json.load(open(os.path.join(dead, "owner.json")))
    reclaimer = greenroom_stopped_at("reclaim-locked", "reclaim", disk_dir)  # it holds the dead run's lock
    try:
        proc = greenroom(
            *TRAIN,
            "--offload-train-disk-dir",
            disk_dir,
            "--metrics",
            str(tmp_path / "m.jsonl"),
            env={"GREENROOM_JOB_ID": "j"},
        )
        line = one_line_error(proc)
        assert (
            f"{dead} is locked, but not by its recorded owner (pid {owner['pid']} on {owner['host']}, which has "
            "exited): a `greenroom reclaim` is deleting what that run left; start again once it is done" in line
        )
        assert "--rank" not in line
    finally:
        os.kill(reclaimer.pid, signal.SIGCONT)
        out, _ = reclaimer.communicate(timeout=120)
    assert reclaimer.returncode == 0 and f"reclaimed: {dead}" in out


def test_a_checkpoint_saved_without_verification_loads_with_it_and_says_so(disk_dir, monkeypatch, caplog):
    """Its bucket files carry no checksums, and the first read must not blame "a flipped
    bit, a failing disk": the load sums the bytes its CRC-32 passed, and verification
    works from there on (a later flip is caught)."""

    def optimizer(name):
        torch.manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(50_000, dtype=torch.bfloat16)) for _ in range(2)]
        return params, StreamingAdam(
            params, state_dir=os.path.join(disk_dir, name), bucket_numel=50_000, chunk_mb=1, resident_numel=0
        )

    def grads(params, seed):
        gen = torch.Generator().manual_seed(seed)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)

    monkeypatch.setenv("GREENROOM_VERIFY", "0")
    params, unverified = optimizer("unverified")
    grads(params, 1)
    unverified.step()
    ckpt = os.path.join(disk_dir, "ckpt")
    unverified.save_checkpoint(ckpt)
    assert json.load(open(os.path.join(ckpt, "manifest.json")))["checksums"] is False
    monkeypatch.delenv("GREENROOM_VERIFY")
    resumed_params, resumed = optimizer("verified")
    try:
        with torch.no_grad():
            for p, q in zip(resumed_params, params):
                p.copy_(q)
        with caplog.at_level(logging.WARNING, logger="greenroom"):
            resumed.load_checkpoint(ckpt)
        assert "saved with GREENROOM_VERIFY=0, so its bucket files carry no checksums" in caplog.text
        for ps, o in ((params, unverified), (resumed_params, resumed)):
            grads(ps, 2)
            o.step()
        for a, b in zip(params, resumed_params):
            assert torch.equal(a, b)
        # Bucket 1 stays on the device for the next step, which reads bucket 0 from its
        # file (optim.store.held Note [the last bucket stays]).
        assert resumed.store.held.kept.index == 1
        with open(resumed.store.path(0), "r+b") as f:
            f.seek(4096 + 7)
            byte = f.read(1)
            f.seek(4096 + 7)
            f.write(bytes([byte[0] ^ 0x01]))
        grads(resumed_params, 3)
        with pytest.raises(IntegrityError, match=r"bucket-00000\.bin: checksum mismatch at offset 0 "):
            resumed.step()
    finally:
        unverified.close()
        resumed.close()
