"""Run by tests/test_torchrun.py under torchrun: an unchanged Horovod-style script; every rank checks
the collectives against numpy and prints one JSON line."""

import json
import sys

import numpy as np
import torch

import hvps.adapters.torch as hvd

import os

size = int(os.environ["WORLD_SIZE"])
# ranks 0 and size-1; at 2 ranks that is every rank, the global set (init refuses a duplicate of it, as Horovod's)
pair = hvd.ProcessSet([0, size - 1]) if size > 2 else hvd.global_process_set
hvd.init(process_sets=[pair] if size > 2 else None)
rank = hvd.rank()
assert hvd.size() == size
rng = np.random.default_rng(1234)
data = rng.standard_normal((size, 37)).astype(np.float32)  # every rank's input, known to all
summed = hvd.allreduce(torch.from_numpy(data[rank]), op=hvd.Sum, name="sum").numpy()
np.testing.assert_allclose(summed, data.sum(axis=0), rtol=1e-5, atol=1e-5)
gathered = hvd.allgather(torch.from_numpy(data[rank][: rank + 1]), name="gather").numpy()
np.testing.assert_array_equal(gathered, np.concatenate([data[r][: r + 1] for r in range(size)]))
root = size - 1
sent = hvd.broadcast(torch.from_numpy(data[rank]), root_rank=root, name="bcast").numpy()
np.testing.assert_array_equal(sent, data[root])
if rank in (0, size - 1):
    got = hvd.allreduce(torch.from_numpy(data[rank]), op=hvd.Sum, name="pair", process_set=pair).numpy()
    np.testing.assert_allclose(got, data[0] + data[size - 1], rtol=1e-5, atol=1e-5)
model = torch.nn.Linear(4, 2)
optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                     named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
x = torch.from_numpy(rng.standard_normal((8, 4)).astype(np.float32)) + rank
model(x).sum().backward()
optimizer.step()
weights = hvd.allgather_object(model.weight.detach().numpy().tolist())
assert all(w == weights[0] for w in weights), "ranks hold different weights after a step"
print(json.dumps({"rank": rank, "size": size, "local_rank": hvd.local_rank(), "local_size": hvd.local_size(),
                  "mpi4py": "mpi4py" in sys.modules}), flush=True)
hvd.shutdown()
