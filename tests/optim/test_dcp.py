"""torch.distributed.checkpoint with FSDP2 (gloo, CPU ranks under torchrun): StreamingAdam's
state saved through ``get_state_dict`` + ``dcp.save`` and loaded through ``dcp.load`` +
``set_state_dict`` resumes bit-exactly; saved on 2 ranks and loaded on 1 or 4 (DCP reshards
the DTensor state), training continues equal to resident AdamW resharded the same way.

The test launches this same file under torchrun; the ``__main__`` part is the worker.
"""

import json
import os
import sys

import pytest

from tests.optim.fsdp_support import REPO, build, torchrun

STEPS = 3


def _torchrun(ranks: int, phase: str, disk_dir: str) -> list[dict]:
    out = os.path.join(disk_dir, f"out-{phase}-{ranks}")
    os.makedirs(out)
    torchrun(ranks, __file__, phase, disk_dir, out)
    results = []
    for rank in range(ranks):
        with open(os.path.join(out, f"rank{rank}.json"), encoding="utf-8") as f:
            results.append(json.load(f))
    return results


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The 2-rank run: trains, saves through DCP (ours and AdamW's), resumes in-process."""
    from greenroom.io import fs

    disk_dir = str(tmp_path_factory.mktemp("dcp"))
    if fs.is_memory_backed(disk_dir):
        disk_dir = os.path.join(REPO, ".run", "test-tmp", os.path.basename(disk_dir))
        os.makedirs(disk_dir)
    return disk_dir, _torchrun(2, "save", disk_dir)


def test_dcp_resume_on_two_ranks_is_bit_exact(saved):
    _, results = saved
    for result in results:
        assert result["probe_steps"] == [0.0] and result["probe_io"] == 0  # _init_optim_state: no step, no I/O
        assert result["equal_to_adamw_before_save"] is True
        assert result["resumed_equal_to_uninterrupted"] is True


@pytest.mark.parametrize("ranks", [1, 4])
def test_saved_on_two_ranks_loads_on_other_counts_like_adamw(saved, ranks):
    disk_dir, _ = saved
    for result in _torchrun(ranks, "load", disk_dir):
        assert result["params_equal"] is True
        assert result["state_equal"] is True
        assert result["steps"] == [float(STEPS + 2)]


# -- the worker ------------------------------------------------------------------------------
def _worker(phase: str, disk_dir: str, out: str) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from greenroom.optim import StreamingAdam

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))

    def ours_opt(net, name):
        return StreamingAdam(
            net.parameters(),
            lr=1e-2,
            state_dir=os.path.join(disk_dir, f"{name}-{world}-{rank}"),
            bucket_numel=1000,
            resident_numel=0,
        )

    def ref_opt(net):
        return torch.optim.AdamW(net.parameters(), lr=1e-2, foreach=True)

    def train_step(net, opt, step):
        # the same global batch at every world size: a world-size-independent reduction
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 33, generator=gen), torch.randn(8, 17, generator=gen)
        lo, hi = rank * 8 // world, (rank + 1) * 8 // world
        opt.zero_grad()
        (torch.nn.functional.mse_loss(net(x[lo:hi]), y[lo:hi], reduction="sum") / 8 * world).backward()
        opt.step()

    def local(t):
        return t.to_local().detach() if hasattr(t, "to_local") else t.detach()

    def params_equal(a, b):
        return all(torch.equal(local(p), local(q)) for p, q in zip(a.parameters(), b.parameters()))

    def state_equal(a, b):
        """Steps and moments of two optimizers over twin models, from their state dicts."""
        sa, sb = a.state_dict()["state"], b.state_dict()["state"]
        if sa.keys() != sb.keys():
            return False
        return all(
            torch.equal(local(sa[i][key]), local(sb[i][key])) for i in sa for key in ("step", "exp_avg", "exp_avg_sq")
        )

    def save(net, opt, path):
        msd, osd = get_state_dict(net, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)

    def load(net, opt, path):
        msd, osd = get_state_dict(net, opt)
        dcp.load({"model": msd, "optim": osd}, checkpoint_id=path)
        set_state_dict(net, opt, model_state_dict=msd, optim_state_dict=osd)

    result = {}
    ckpt_ours, ckpt_ref = os.path.join(disk_dir, "ckpt-ours"), os.path.join(disk_dir, "ckpt-ref")
    if phase == "save":
        net, ref_net = build(mesh), build(mesh)
        opt, ref = ours_opt(net, "ours"), ref_opt(ref_net)
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        probe = ours_opt(build(mesh), "probe")
        _init_optim_state(probe)
        result["probe_steps"] = sorted({float(s["step"]) for s in probe.state.values()})
        result["probe_io"] = probe.store.bytes_read + probe.store.bytes_written - probe.store.state_bytes
        probe.close()
        for step in range(STEPS):
            train_step(net, opt, step)
            train_step(ref_net, ref, step)
        result["equal_to_adamw_before_save"] = params_equal(net, ref_net) and state_equal(opt, ref)
        save(net, opt, ckpt_ours)
        save(ref_net, ref, ckpt_ref)
        for step in range(STEPS, STEPS + 2):
            train_step(net, opt, step)
        again = build(mesh)
        resumed = ours_opt(again, "resumed")
        load(again, resumed, ckpt_ours)
        for step in range(STEPS, STEPS + 2):
            train_step(again, resumed, step)
        result["resumed_equal_to_uninterrupted"] = params_equal(net, again) and state_equal(resumed, opt)
        for o in (opt, resumed):
            o.close()
    else:
        net, ref_net = build(mesh), build(mesh)
        opt, ref = ours_opt(net, "loaded"), ref_opt(ref_net)
        load(net, opt, ckpt_ours)
        load(ref_net, ref, ckpt_ref)
        for step in range(STEPS, STEPS + 2):
            train_step(net, opt, step)
            train_step(ref_net, ref, step)
        result["params_equal"] = params_equal(net, ref_net)
        result["state_equal"] = state_equal(opt, ref)
        result["steps"] = sorted({float(s["step"]) for s in opt.state.values()})
        opt.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w", encoding="utf-8") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    _worker(sys.argv[1], sys.argv[2], sys.argv[3])
