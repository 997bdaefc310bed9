"""A real process that trains with ``StreamingAdam`` on a plain ``state_dir`` beside
``torch.optim.AdamW`` and says whether they stayed bit-identical.

    python statedir_worker.py ROOT MODE

MODE ``hold``: after building, print the state dir and wait for a line on stdin (so two
processes own their dirs at the same time); ``barrier``: under torchrun, init gloo and
meet the other ranks instead; ``run``: neither; ``crash``: print the state dir and SIGKILL itself (a
crashed owner for ``greenroom reclaim``). A refused optimizer prints ``refused: <the
error>`` and exits 3.
"""

import os
import signal
import sys

import torch

from greenroom.errors import GreenroomError
from greenroom.optim import StreamingAdam

root, mode = sys.argv[1], sys.argv[2]
if mode == "barrier":
    import torch.distributed as dist

    dist.init_process_group("gloo")
torch.manual_seed(int(os.environ.get("RANK", "0")))  # each rank its own params
ours = [torch.nn.Parameter(torch.randn(300, 70)), torch.nn.Parameter(torch.randn(5000))]
theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
try:
    opt = StreamingAdam(ours, lr=1e-2, state_dir=root, bucket_numel=4000, chunk_mb=1, resident_numel=0)
except GreenroomError as e:
    print(f"refused: {e}", flush=True)
    sys.exit(3)
print(opt.state_dir, flush=True)
if mode == "crash":
    os.kill(os.getpid(), signal.SIGKILL)
if mode == "hold":
    sys.stdin.readline()
elif mode == "barrier":
    dist.barrier()  # every rank holds its dir before any closes
reference = torch.optim.AdamW(theirs, lr=1e-2, foreach=opt.foreach, fused=opt.fused)
for step in range(4):
    g = torch.Generator().manual_seed(100 + step)
    for a, b in zip(ours, theirs):
        a.grad = torch.randn(a.shape, generator=g)
        b.grad = a.grad.clone()
    opt.step()
    reference.step()
same = all(torch.equal(a, b) for a, b in zip(ours, theirs))
opt.close()
print("bit-identical" if same else "DIFFERENT", flush=True)
