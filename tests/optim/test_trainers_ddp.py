"""The Hugging Face Trainer example of docs/streaming.md, as written, on 2 gloo ranks.

The test reads the example's code block from the doc and runs it under torchrun: first
everything but its resume line (train 100 steps, checkpoints at 50 and 100), then, in new
processes, everything but its first ``trainer.train()`` (resume from ``out/checkpoint-50``).
The doc's one host path, ``/nvme/run1``, is moved under the test's scratch dir; nothing else
of the text changes. The user's part the example leaves out (``model``, ``data``) is a tiny
Llama and a token dataset, the same on every rank. Both ranks run the same
``StreamingAdam(..., state_dir=...)`` line: each must get its own dir (or one would
overwrite the other's state), and the resumed run must end bit-identical to the
uninterrupted one (every weight and every optimizer state tensor of checkpoint-100).
"""

import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DOC = os.path.join(REPO, "docs", "streaming.md")
HOST_PATH = "/nvme/run1"


def doc_example() -> tuple[str, str]:
    """The example's code for the first run and for the resume."""
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    match = re.search(r"\*\*Hugging Face Trainer\*\*.*?```python\n(.*?)```", text, re.S)
    assert match, "docs/streaming.md has no Hugging Face Trainer example"
    lines = match.group(1).splitlines()
    train = [i for i, line in enumerate(lines) if line.startswith("trainer.train()")]
    resume = [i for i, line in enumerate(lines) if line.startswith("trainer.train(resume_from_checkpoint=")]
    assert len(train) == 1 and len(resume) == 1 and resume[0] == len(lines) - 1, lines
    first = "\n".join(line for i, line in enumerate(lines) if i != resume[0])
    again = "\n".join(line for i, line in enumerate(lines) if i != train[0])
    return first, again


def _torchrun(phase: str, workdir: str) -> None:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "GREENROOM_JOB_ID", "SLURM_JOB_ID", "TORCHELASTIC_RUN_ID")
    }
    env.update(
        PYTHONPATH=os.path.join(REPO, "runtime") + os.pathsep + REPO,
        OMP_NUM_THREADS="1",
        CUDA_VISIBLE_DEVICES="",
        TOKENIZERS_PARALLELISM="false",
    )
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            os.path.abspath(__file__),
            phase,
            workdir,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        cwd=workdir,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]


def _state_tensors(checkpoint: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {f"model.{k}": v for k, v in load_file(os.path.join(checkpoint, "model.safetensors")).items()}
    optim = torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True)
    for index, state in optim["state"].items():
        tensors.update({f"optim.{index}.{key}": value for key, value in state.items()})
    return tensors


def test_the_docs_hf_trainer_example_runs_on_2_ranks_and_resumes_bit_identically(disk_dir):
    pytest.importorskip("transformers", reason="the test extra pins transformers")
    pytest.importorskip("accelerate", reason="the test extra pins accelerate")
    workdir = os.path.join(disk_dir, "work")
    os.makedirs(workdir)
    _torchrun("first", workdir)
    out = os.path.join(workdir, "out")
    assert {"checkpoint-50", "checkpoint-100"} <= set(os.listdir(out))
    shutil.move(os.path.join(out, "checkpoint-100"), os.path.join(workdir, "uninterrupted-100"))
    _torchrun("resume", workdir)
    full = _state_tensors(os.path.join(workdir, "uninterrupted-100"))
    resumed = _state_tensors(os.path.join(out, "checkpoint-100"))
    assert full.keys() == resumed.keys() and any(k.endswith(".exp_avg") for k in full)
    for key in full:
        assert torch.equal(full[key], resumed[key]), key
    state_root = workdir + HOST_PATH + "/optim"
    assert os.listdir(state_root) == [], "every rank's state dir went when its process exited"


if __name__ == "__main__":  # one rank of the example, under torchrun
    phase, workdir = sys.argv[1], sys.argv[2]
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
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
    tokens = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(1))
    data = [{"input_ids": t, "labels": t} for t in tokens]
    first, again = doc_example()
    code = (first if phase == "first" else again).replace(HOST_PATH, workdir + HOST_PATH)
    seen = {"model": model, "data": data, "__name__": "example"}
    exec(compile(code, DOC, "exec"), seen)
    # Both ranks built their optimizer from the same line: each owns a dir of its own.
    rank = int(os.environ["RANK"])
    assert seen["opt"].state_dir.endswith(os.path.join("optim", f"rank{rank:05d}", "optim")), seen["opt"].state_dir
