"""Deterministic restartable training for tests/test_recovery.py (not collected by pytest).

A small MLP (fixed seed, dropout drawing from each rank's torch RNG), trained with
``hvd.DistributedOptimizer`` (SGD, momentum) on data derived from (epoch, step, rank)
only; after every epoch all ranks save with ``hvd.CheckpointManager`` into
``HVPS_CHECKPOINT_DIR``, and every start resumes from the latest valid version.

With ``KILL_EPOCH=k`` and ``KILL_DIR=D``, rank 1 on the first try (HVPS_RESTART_COUNT=0),
halfway through epoch k, writes its pid to ``D/rank1.pid`` and waits for the test to
SIGKILL it (it exits with 3 if nobody does within 60 s).  At the end rank 0 writes the
parameters and the optimizer's momentum buffers to ``OUT`` (an .npz).
Env: EPOCHS (5), STEPS (steps per epoch, 6), OUT, KILL_EPOCH, KILL_DIR.
"""
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

import hvps.adapters.torch as hvd

torch.set_num_threads(1)
torch.use_deterministic_algorithms(True)
hvd.init()
rank, size = hvd.rank(), hvd.size()
restart = int(os.environ.get("HVPS_RESTART_COUNT", "0"))
epochs = int(os.environ.get("EPOCHS", "5"))
steps = int(os.environ.get("STEPS", "6"))
kill_epoch = int(os.environ.get("KILL_EPOCH", "-1"))
kill_dir = os.environ.get("KILL_DIR")

torch.manual_seed(1234)  # the same initial weights everywhere
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(32, 4))
torch.manual_seed(100 + rank)  # each rank its own dropout masks (restored from checkpoints)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)

ckpt = hvd.CheckpointManager(os.environ["HVPS_CHECKPOINT_DIR"], keep_last=2)
start = ckpt.load(model=model, optimizer=opt)
print(f"RESUME rank {rank} restart {restart} from epoch {start} pid {os.getpid()}", flush=True)


def batch(epoch, step):
    g = torch.Generator().manual_seed(10_000 * epoch + 100 * step + rank)
    x = torch.randn(8, 16, generator=g)
    return x, (x[:, :4].sum(1) > 0).long() + 2 * (x[:, 4] > 0).long()


for epoch in range(start, epochs):
    for step in range(steps):
        if (epoch == kill_epoch and step == steps // 2 and restart == 0 and rank == 1 and kill_dir):
            tmp = Path(kill_dir) / f".rank1.pid.{os.getpid()}"
            tmp.write_text(str(os.getpid()))
            os.replace(tmp, Path(kill_dir) / "rank1.pid")
            print(f"WAITING rank {rank} pid {os.getpid()} in epoch {epoch} step {step}", flush=True)
            time.sleep(60)
            print("NOT KILLED", flush=True)
            os._exit(3)
        x, y = batch(epoch, step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
    ckpt.save(epoch, model=model, optimizer=opt, step=(epoch + 1) * steps, extra={"restart": restart})
    print(f"EPOCH rank {rank} restart {restart} epoch {epoch} saved", flush=True)

if rank == 0:
    state = {f"param.{k}": v.detach().numpy() for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        state[f"momentum.{i}"] = s["momentum_buffer"].numpy()
    out = os.environ["OUT"]
    np.savez(out + ".tmp.npz", **state)
    os.replace(out + ".tmp.npz", out)
print(f"FINISHED rank {rank} restart {restart}", flush=True)
hvd.shutdown()
sys.exit(0)
