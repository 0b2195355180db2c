"""``python -m hvps.runner.preflight``: one line per rank proving the launch is wired up.

Run it with the same launcher as the job (mpirun, hvpsrun, srun --mpi=pmix) before
spending hours on training: every rank prints its place and checks an allreduce and
an allgather across all ranks; the exit status is 1 on any mismatch.
"""

from __future__ import annotations

import socket
import sys

import numpy as np


def main() -> int:
    from .. import api as hvps

    hvps.init()
    rank, size = hvps.rank(), hvps.size()
    total = int(hvps.allreduce(np.array([rank + 1], dtype=np.int64), op=hvps.Sum, name="preflight.sum")[0])
    ranks = hvps.allgather(np.array([rank], dtype=np.int64), name="preflight.ranks").tolist()
    ok = total == size * (size + 1) // 2 and ranks == list(range(size))
    # one write per line, so that launchers that tag or merge output keep it whole
    sys.stdout.write(f"hvps preflight: rank {rank}/{size} local {hvps.local_rank()}/{hvps.local_size()} "
                     f"cross {hvps.cross_rank()}/{hvps.cross_size()} on {socket.gethostname()}: "
                     f"{'ok' if ok else f'MISMATCH sum={total} ranks={ranks}'}\n")
    sys.stdout.flush()
    hvps.shutdown()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
