"""A tiny restartable "training" run for the restart tests (not collected by pytest).

Epochs are allreduces; after each, rank 0 writes ``epoch-<n>.json`` to
``HVPS_CHECKPOINT_DIR``. A start resumes after the latest checkpoint. With
``FAIL_AT_EPOCH=k``, rank 1 crashes in epoch k on the first try (HVPS_RESTART_COUNT=0).
Env: EPOCHS (default 4), FAIL_AT_EPOCH (default: never).
"""
import json
import os
import sys
from pathlib import Path

import numpy as np

import hvps

hvps.init()
rank, size = hvps.rank(), hvps.size()
ckpt = Path(os.environ["HVPS_CHECKPOINT_DIR"])
restart = int(os.environ.get("HVPS_RESTART_COUNT", "0"))
epochs = int(os.environ.get("EPOCHS", "4"))
fail_at = int(os.environ.get("FAIL_AT_EPOCH", "-1"))
done = sorted(int(p.stem.split("-")[1]) for p in ckpt.glob("epoch-*.json"))
start = done[-1] + 1 if done else 0
print(f"RESUME rank {rank} restart {restart} from epoch {start}", flush=True)
for epoch in range(start, epochs):
    if epoch == fail_at and restart == 0 and rank == min(1, size - 1):
        print(f"CRASH rank {rank} in epoch {epoch}", flush=True)
        os._exit(17)
    total = hvps.allreduce(np.array([epoch + rank], dtype=np.int64), op=hvps.Sum, name=f"epoch{epoch}")
    if rank == 0:
        (ckpt / f"epoch-{epoch}.json").write_text(json.dumps({"epoch": epoch, "sum": int(total[0]),
                                                              "restart": restart}))
    hvps.barrier()
print(f"FINISHED rank {rank} restart {restart}", flush=True)
hvps.shutdown()
sys.exit(0)
