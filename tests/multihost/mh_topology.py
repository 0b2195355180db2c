"""Inner script for tests/test_multihost.py (run on every rank, not collected by pytest).

Prints one line ``TOPOLOGY {json}`` per rank: where it runs (hostname, topology) and
the results of collectives that depend on every rank's contribution.
"""
import json
import socket
import sys

import numpy as np

import hvps

hvps.init()
rank, size = hvps.rank(), hvps.size()
total = hvps.allreduce(np.array([rank + 1], dtype=np.int64), op=hvps.Sum)
names = hvps.allgather_object(socket.gethostname())
root_value = hvps.broadcast(np.array([rank * 10 + 7], dtype=np.int64), root_rank=size - 1)
sys.stdout.write("TOPOLOGY " + json.dumps({
    "rank": rank, "size": size, "local_rank": hvps.local_rank(), "local_size": hvps.local_size(),
    "cross_rank": hvps.cross_rank(), "cross_size": hvps.cross_size(), "hostname": socket.gethostname(),
    "sum": int(total[0]), "hostnames": names, "broadcast": int(root_value[0]),
}) + "\n")  # one write: mpirun --tag-output keeps the line whole
sys.stdout.flush()
hvps.shutdown()
