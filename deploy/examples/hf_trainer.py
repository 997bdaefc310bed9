"""A Hugging Face Trainer script using greenroom, its flags from $GREENROOM_ARGS (set by the
Helm chart and the Slurm templates). Run: python hf_trainer.py OUTPUT_DIR [--steps N]."""

import argparse
import os

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

import greenroom
from greenroom.actor import build_offloader
from greenroom.dirs.rankdir import RankDir
from greenroom.optim import StreamingAdam

parser = greenroom.add_arguments(argparse.ArgumentParser())  # defaults: $GREENROOM_ARGS
parser.add_argument("output_dir")
parser.add_argument("--steps", type=int, default=4)
args = parser.parse_args()
offload = greenroom.OffloadConfig.from_args(args)
# Files only where a mechanism writes them (the disk target, streaming): the chart's cpu
# target or no flags at all need no dir.
rank_dir = (
    RankDir(
        offload.offload_train_disk_dir, rank=int(os.environ.get("RANK", "0")), allow_tmpfs=offload.allow_tmpfs
    ).open()
    if offload.uses_disk
    else None
)

training = TrainingArguments(
    output_dir=args.output_dir,
    max_steps=args.steps,
    per_device_train_batch_size=2,
    use_cpu=not torch.cuda.is_available(),
    report_to=[],
    save_strategy="no",
    disable_tqdm=True,
    logging_steps=1,
)
torch.manual_seed(0)
model = LlamaForCausalLM(
    LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
)
model.to(training.device)  # before the optimizer and the offloader see its params
optimizer = (
    StreamingAdam.from_config(model.parameters(), offload, rank_dir, lr=1e-3)  # its own optim/ of the rank dir
    if offload.stream_optimizer_state_to_disk
    else torch.optim.AdamW(model.parameters(), lr=1e-3)
)
offloader = build_offloader(offload, rank_dir, device=training.device).track(model, optimizer)


class SleepBetweenSteps(TrainerCallback):
    """The actor sleeps where an RL loop would generate rollouts, and wakes to train."""

    def on_step_end(self, train_args, state, control, **kwargs):
        slept, woke = offloader.sleep(), offloader.wake()
        print(
            f"rank {train_args.process_index} of {train_args.world_size} step {state.global_step}: "
            f"slept {slept.nbytes} B, woke {woke.nbytes} B"
        )


tokens = torch.randint(0, 64, (16, 16), generator=torch.Generator().manual_seed(0))
data = [{"input_ids": t, "labels": t} for t in tokens]
Trainer(
    model=model, args=training, train_dataset=data, optimizers=(optimizer, None), callbacks=[SleepBetweenSteps()]
).train()
offloader.close()
if isinstance(optimizer, StreamingAdam):
    optimizer.close()
if rank_dir is not None:
    rank_dir.close()
