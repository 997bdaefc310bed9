"""A ``greenroom train`` run resolves its codec once: the offloader and the streaming
optimizer write with that one codec, and the header names it."""

import os

import pytest

from greenroom.config import OffloadConfig
from greenroom.io import compression
from greenroom.train.config import TrainConfig
from greenroom.train.model import ModelConfig
from greenroom.train.task import VOCAB_SIZE, TaskConfig
from greenroom.train.trainer import Trainer


@pytest.mark.parametrize("codec", ["zstd", "auto"])
def test_one_resolution_reaches_both_mechanisms_and_the_header(disk_dir, monkeypatch, codec):
    calls = []
    real = compression.resolve

    def counted(choice, **kwargs):
        calls.append(choice)
        return real(choice, **kwargs)

    monkeypatch.setattr(compression, "resolve", counted)
    monkeypatch.setenv("GREENROOM_JOB_ID", "codec")
    task = TaskConfig()
    offload = OffloadConfig(
        offload_train=True,
        offload_train_target="disk",
        offload_train_disk_dir=disk_dir,
        offload_train_disk_chunk_mb=8,
        offload_train_disk_compression=codec,
        stream_optimizer_state_to_disk=True,
    )
    trainer = Trainer(
        TrainConfig(iterations=1, metrics=os.path.join(disk_dir, "m.jsonl"), progress=False, device="cpu"),
        offload=offload,
        task=task,
        model=ModelConfig(vocab_size=VOCAB_SIZE, d_model=16, n_layers=1, n_heads=2, max_seq_len=task.seq_len),
    )
    with trainer:
        header = trainer._header(0)
        used = trainer.optimizer.compression
        assert calls == [codec]  # the offloader, the optimizer and the header each took the run's one
        assert used is trainer.compression
        # The store writes with the codec the header names.
        assert f", {used.line}, " in header
        # On the CPU auto runs none (its line says why); zstd runs zstd.
        assert trainer.optimizer.store.layout()["compression"] == ("zstd" if codec == "zstd" else "none")
        assert used.line.startswith("compression: zstd" if codec == "zstd" else "compression: none (auto: no GPU")
