"""The peer of ``greenroom bench stream --against deepspeed``: DeepSpeed ZeRO-Infinity with
its optimizer state on NVMe, timed on the same params, dtype and disk dir.

Run by ``bench stream`` as a child process (``python -m greenroom.cli.bench.deepspeed_peer``),
after greenroom's own measurement, so the two never share a process or its memory.
DeepSpeed is a bench-only optional dependency (the ``deepspeed`` extra): nothing in the
runtime imports it, and only this child does.

What runs: ZeRO stage 3 on one GPU (a one-rank process group), bf16 params resident on
the GPU, the optimizer (DeepSpeed's CPU AdamW: lr 1e-4, weight decay 0.01, as greenroom's
bench) offloaded to NVMe through its ``async_io`` op at ``--dir``. The model is a list of
flat bf16 params of ``--param-numel`` elements each (the same split as greenroom's
bench), each used once in the forward so that every param gets a grad. Each step is a
forward, ``engine.backward`` and ``engine.step``; the step's seconds are those of
``engine.step`` (the optimizer: swap in, CPU Adam, swap out, params back), which is what
greenroom's ``opt.step()`` covers; the backward's seconds (where ZeRO-3 moves the grads
to the host) are reported beside it.

DeepSpeed needs libaio (``libaio-dev``; point ``CPATH``, ``LIBRARY_PATH`` and
``LD_LIBRARY_PATH`` at a prefix holding it) and, for an arch list torch reports as
``9.0a``, ``TORCH_CUDA_ARCH_LIST=9.0`` (its op builder cannot parse the suffix).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def measure(params: int, directory: str, steps: int, param_numel: int) -> dict:
    import deepspeed
    import torch

    from greenroom.actor.memory import RssSampler

    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    sizes = [min(param_numel, params - start) for start in range(0, params, param_numel)]

    class Flat(torch.nn.Module):
        def __init__(self, numel: int) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(numel, dtype=torch.bfloat16).normal_())

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.weight.float().mean()

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = torch.nn.ModuleList(Flat(n) for n in sizes)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x.sum()

    nvme = os.path.join(directory, "deepspeed-nvme")
    os.makedirs(nvme, exist_ok=True)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.01}},
        "zero_optimization": {
            "stage": 3,
            "offload_optimizer": {
                "device": "nvme",
                "nvme_path": nvme,
                "pin_memory": True,
                "buffer_count": 4,
                "fast_init": False,
            },
            "sub_group_size": 100_000_000,
        },
        "aio": {
            "block_size": 1 << 20,
            "queue_depth": 16,
            "intra_op_parallelism": 1,
            "single_submit": False,
            "overlap_events": True,
        },
        "steps_per_print": 1 << 30,
    }
    with RssSampler(0.02) as init_host:
        start = time.perf_counter()
        with deepspeed.zero.Init(config_dict_or_path=config, dtype=torch.bfloat16):  # params partitioned on the GPU
            model = Model()
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        torch.cuda.synchronize(device)
        init_seconds = time.perf_counter() - start
    x = torch.zeros(1, device=device, dtype=torch.bfloat16)
    rows = []
    with RssSampler(0.02) as host:
        for _ in range(steps):
            torch.cuda.reset_peak_memory_stats(device)
            start = time.perf_counter()
            loss = engine(x)
            engine.backward(loss)
            torch.cuda.synchronize(device)
            backward = time.perf_counter() - start
            start, cpu_start = time.perf_counter(), time.process_time()
            engine.step()
            torch.cuda.synchronize(device)
            rows.append(
                {
                    "step_seconds": time.perf_counter() - start,
                    "forward_backward_seconds": backward,
                    "cpu_seconds": time.process_time() - cpu_start,  # its CPU Adam's threads included
                    "peak_device_bytes": torch.cuda.max_memory_allocated(device),
                }
            )
    nvme_bytes = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(nvme) for f in files)
    return {
        "deepspeed": deepspeed.__version__,
        "params": sum(sizes),
        "param_dtype": "bf16",
        "dir": nvme,
        "init_seconds": init_seconds,
        "steps": rows,
        "step_seconds": rows[-1]["step_seconds"],
        "host_rss_peak_bytes": max(host.peak, init_host.peak),
        "peak_device_bytes": max(r["peak_device_bytes"] for r in rows),
        "nvme_file_bytes": nvme_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m greenroom.cli.bench.deepspeed_peer")
    parser.add_argument("--params", type=int, required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--param-numel", type=int, required=True)
    args = parser.parse_args(argv)
    result = measure(args.params, args.dir, args.steps, args.param_numel)
    sys.stdout.flush()
    print("GREENROOM-PEER " + json.dumps(result, sort_keys=True), flush=True)  # DeepSpeed logs to stdout too
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
