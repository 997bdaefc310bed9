"""What the streaming optimizers share (``greenroom.optim.streamed``): torch's
state-dict hooks run around both formats, in torch's order, and a hook's replacement is
what comes out (or goes in). CPU, real bucket files."""

import os

import pytest
import torch

from greenroom.optim import StreamingAdam, StreamingMuon


@pytest.mark.parametrize("kind", [StreamingAdam, StreamingMuon], ids=lambda k: k.__name__)
def test_state_dict_hooks_run_in_torchs_order_and_their_replacements_are_used(disk_dir, kind):
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(64, 64)) for _ in range(2)]
    opt = kind(params, lr=1e-2, state_dir=os.path.join(disk_dir, "opt"), bucket_numel=4096, chunk_mb=1)
    calls = []
    try:
        for p in params:
            p.grad = torch.randn_like(p)
        opt.step()
        opt.register_state_dict_pre_hook(lambda o: calls.append(("save pre", o is opt)))
        opt.register_state_dict_post_hook(lambda o, sd: calls.append(("save post", o is opt)) or {**sd, "extra": 1})
        saved = opt.state_dict()
        assert saved["extra"] == 1 and set(saved["state"]) == {0, 1}
        saved = {k: v for k, v in saved.items() if k != "extra"}
        copied = {
            "state": {i: {k: t.clone() for k, t in s.items()} for i, s in saved["state"].items()},
            "param_groups": saved["param_groups"],
        }

        def drop_extra(o, sd):
            calls.append(("load pre", o is opt))
            return {k: v for k, v in sd.items() if k != "unknown"}

        opt.register_load_state_dict_pre_hook(drop_extra)
        opt.register_load_state_dict_post_hook(lambda o: calls.append(("load post", o is opt)))
        opt.load_state_dict({**copied, "unknown": None})
        assert calls == [("save pre", True), ("save post", True), ("load pre", True), ("load post", True)]
        for i, state in copied["state"].items():
            for name, t in state.items():
                assert torch.equal(opt.state_dict()["state"][i][name], t), (i, name)
    finally:
        opt.close()
