"""FSDP2 (fully_shard, DTensor params) on 2 ranks under torchrun (gloo, CPU): each rank
streams its local shards from its own rank dir, bit-identical to resident AdamW.

The test launches this same file under torchrun; the ``__main__`` part is the worker.
"""

import json
import os
import sys

from tests.optim.fsdp_support import build, torchrun

STEPS = 4


def test_fsdp2_two_ranks_bit_identical_to_resident_adamw(disk_dir):
    out = os.path.join(disk_dir, "out")
    os.makedirs(out)
    torchrun(2, __file__, disk_dir, out)
    for rank in (0, 1):
        with open(os.path.join(out, f"rank{rank}.json"), encoding="utf-8") as f:
            result = json.load(f)
        assert result["equal_each_step"] == [True] * STEPS
        assert result["equal_after_resume"] is True
        assert result["empty_shards"] == (1 if rank == 1 else 0)  # a 1-row param leaves rank 1 nothing
        assert result["dir_exists_before_exit"] is True
        assert "same-topology only" in result["other_rank_refusal"]
    assert os.listdir(os.path.join(disk_dir, "root")) == []  # every rank removed its dir


def _worker(disk_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from greenroom.dirs.rankdir import RankDir
    from greenroom.errors import CheckpointError
    from greenroom.optim import StreamingAdam

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def batch(step):
        gen = torch.Generator().manual_seed(100 * step + rank)
        return torch.randn(8, 33, generator=gen), torch.randn(8, 17, generator=gen)

    def train_step(net, opt, step):
        x, y = batch(step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x), y).backward()
        opt.step()

    def local(p):
        return p.to_local().detach()

    ours, ref = build(mesh), build(mesh)
    result = {}
    with RankDir(os.path.join(disk_dir, "root"), rank=rank, job="fsdp") as rank_dir:
        opt = StreamingAdam(
            ours.parameters(), lr=1e-2, weight_decay=0.01, state_dir=rank_dir, bucket_numel=1000, resident_numel=0
        )
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01, foreach=True)
        result["empty_shards"] = sum(1 for p in ours.parameters() if local(p).numel() == 0)
        equal = []
        for step in range(STEPS):
            train_step(ours, opt, step)
            train_step(ref, ref_opt, step)
            equal.append(all(torch.equal(local(a), local(b)) for a, b in zip(ours.parameters(), ref.parameters())))
        result["equal_each_step"] = equal
        ckpt = os.path.join(disk_dir, "ckpt", f"rank{rank}")
        opt.save_checkpoint(ckpt)
        opt.close()
        dist.barrier()
        opt = StreamingAdam(
            ours.parameters(),
            lr=1e-2,
            weight_decay=0.01,
            state_dir=rank_dir.subdir("again"),
            bucket_numel=1000,
            resident_numel=0,
        )
        try:
            opt.load_checkpoint(os.path.join(disk_dir, "ckpt", f"rank{1 - rank}"))
            result["other_rank_refusal"] = "loaded"
        except CheckpointError as e:
            result["other_rank_refusal"] = str(e)
        opt.load_checkpoint(ckpt)
        for step in range(STEPS, STEPS + 2):
            train_step(ours, opt, step)
            train_step(ref, ref_opt, step)
        result["equal_after_resume"] = all(
            torch.equal(local(a), local(b)) for a, b in zip(ours.parameters(), ref.parameters())
        )
        opt.close()
        result["dir_exists_before_exit"] = os.path.isdir(rank_dir.path)
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2])
