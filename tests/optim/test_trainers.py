"""StreamingAdam in the trainers people already run, on the CPU with the real packages:
Hugging Face ``Trainer`` (transformers + accelerate) and PyTorch Lightning. Each trains,
checkpoints, resumes from the checkpoint in a fresh process state (new model, new
optimizer, new state dir) and must end bit-identical to the uninterrupted run."""

import os
import warnings

import pytest
import torch

from greenroom.optim import StreamingAdam


def _equal_models(a: torch.nn.Module, b: torch.nn.Module) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _equal_optimizers(a: StreamingAdam, b: StreamingAdam) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa["param_groups"] == sb["param_groups"] and sa["state"].keys() == sb["state"].keys()
    for i, state in sa["state"].items():
        for key, value in state.items():
            assert torch.equal(value, sb["state"][i][key]), (i, key)


# -- Hugging Face Trainer -------------------------------------------------------------------
def test_hf_trainer_resume_is_bit_identical(disk_dir):
    transformers = pytest.importorskip("transformers", reason="the test extra pins transformers")
    pytest.importorskip("accelerate", reason="the test extra pins accelerate")
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments, get_linear_schedule_with_warmup

    transformers.logging.set_verbosity_error()
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 64, (24, 16), generator=gen)
    data = [{"input_ids": t, "labels": t} for t in tokens]

    def run(name, resume=None):
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        opt = StreamingAdam(
            model.parameters(), lr=3e-3, state_dir=os.path.join(disk_dir, f"state-{name}"), bucket_numel=20_000
        )
        sched = get_linear_schedule_with_warmup(opt, num_warmup_steps=2, num_training_steps=6)
        args = TrainingArguments(
            output_dir=os.path.join(disk_dir, "out-full"),
            max_steps=6,
            save_steps=3,
            per_device_train_batch_size=4,
            learning_rate=3e-3,
            use_cpu=True,
            seed=0,
            report_to=[],
            logging_steps=100,
            dataloader_num_workers=0,
            disable_tqdm=True,
            save_only_model=False,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, sched))
        trainer.train(resume_from_checkpoint=resume)
        return model, opt

    full_model, full_opt = run("full")
    checkpoint = os.path.join(disk_dir, "out-full", "checkpoint-3")
    assert os.path.exists(os.path.join(checkpoint, "optimizer.pt"))
    saved = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
    assert saved["param_groups"][0]["moment_dtype"] == "fp32" and all(
        float(s["step"]) == 3 for s in saved["state"].values()
    )
    resumed_model, resumed_opt = run("resumed", resume=checkpoint)
    _equal_models(full_model, resumed_model)
    _equal_optimizers(full_opt, resumed_opt)
    full_opt.close()
    resumed_opt.close()


# -- PyTorch Lightning ------------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint_io", ["lightning", "greenroom"])
def test_lightning_resume_is_bit_identical(disk_dir, checkpoint_io):
    lightning = pytest.importorskip("lightning", reason="the test extra pins lightning")
    from lightning.pytorch.callbacks import ModelCheckpoint

    from greenroom.optim.lightning import StreamingCheckpointIO

    plugins = [StreamingCheckpointIO()] if checkpoint_io == "greenroom" else []

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(24, 16, generator=gen), torch.randn(24, 4, generator=gen)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)

    class Net(lightning.LightningModule):
        def __init__(self, state_dir):
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 256), torch.nn.Tanh(), torch.nn.Linear(256, 4))
            self.state_dir = state_dir

        def training_step(self, batch, _):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return StreamingAdam(self.parameters(), lr=1e-2, state_dir=self.state_dir, bucket_numel=3000)

    def run(name, epochs, ckpt_path=None):
        module = Net(os.path.join(disk_dir, f"state-{name}"))
        checkpoints = ModelCheckpoint(
            dirpath=os.path.join(disk_dir, f"ckpt-{name}"), save_top_k=-1, every_n_epochs=1, filename="{epoch}"
        )
        trainer = lightning.Trainer(
            max_epochs=epochs,
            accelerator="cpu",
            devices=1,
            logger=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            deterministic=True,
            callbacks=[checkpoints],
            plugins=plugins,
        )
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # num_workers advice and the like
            trainer.fit(module, loader, ckpt_path=ckpt_path)
        assert not plugins or trainer.strategy.checkpoint_io is plugins[0]
        return module, trainer.optimizers[0]

    full, full_opt = run("full", 3)
    resumed, resumed_opt = run("resumed", 3, ckpt_path=os.path.join(disk_dir, "ckpt-full", "epoch=0.ckpt"))
    assert isinstance(resumed_opt, StreamingAdam)
    _equal_models(full, resumed)
    _equal_optimizers(full_opt, resumed_opt)
    full_opt.close()
    resumed_opt.close()
