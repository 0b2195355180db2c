"""Run by tests/test_gloo_run.py and tests/test_multihost_gloo.py under ``hvpsrun --gloo``: an
unchanged Horovod-style script.

``MODE=check`` (default): every rank checks collectives against numpy and prints one JSON line with
its hostname, topology, Horovod's variables and whether mpi4py was imported. ``MODE=fail``: rank ``VICTIM``
dies (``os._exit(3)``, as a crash: no atexit shutdown) after a first collective while the others
wait in a second one, on the first try only
(``HVPS_RESTART_COUNT=0``); later tries run as ``check``.
"""

import json
import os
import socket
import sys

import numpy as np
import torch

import hvps.adapters.torch as hvd

hvd.init()
rank, size = hvd.rank(), hvd.size()
rng = np.random.default_rng(4321)
data = rng.standard_normal((size, 41)).astype(np.float32)  # every rank's input, known to all
summed = hvd.allreduce(torch.from_numpy(data[rank]), op=hvd.Sum, name="sum").numpy()
np.testing.assert_allclose(summed, data.sum(axis=0), rtol=1e-5, atol=1e-5)

if os.environ.get("MODE") == "fail" and os.environ.get("HVPS_RESTART_COUNT") == "0":
    if rank == int(os.environ["VICTIM"]):
        os._exit(3)
    hvd.allreduce(torch.from_numpy(data[rank]), op=hvd.Sum, name="never")  # the launcher ends this rank
    print(f"rank {rank}: NO ERROR", flush=True)
    sys.exit(0)

gathered = hvd.allgather(torch.from_numpy(data[rank][: rank + 1]), name="gather").numpy()
np.testing.assert_array_equal(gathered, np.concatenate([data[r][: r + 1] for r in range(size)]))
sent = hvd.broadcast(torch.from_numpy(data[rank]), root_rank=size - 1, name="bcast").numpy()
np.testing.assert_array_equal(sent, data[size - 1])
print(json.dumps({"rank": rank, "size": size, "hostname": socket.gethostname(), "local_rank": hvd.local_rank(),
                  "local_size": hvd.local_size(),
                  "cross_rank": hvd.cross_rank(), "cross_size": hvd.cross_size(),
                  "horovod": {k: v for k, v in os.environ.items() if k.startswith("HOROVOD_")},
                  "mpi4py": "mpi4py" in sys.modules, "restart": os.environ.get("HVPS_RESTART_COUNT")}), flush=True)
hvd.shutdown()
