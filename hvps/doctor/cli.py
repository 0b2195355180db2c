"""``hvps doctor``'s flags; ``register`` adds them to the ``hvps`` command (``hvps.cli``)."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..core.numbers import positive

DESCRIPTION = """\
Check this node for distributed training: CPU governor, SMT, NUMA binding, transparent huge
pages, swappiness, memlock/nofile limits, /dev/shm, cgroup CPU and memory limits, real-time
scheduling and scheduler granularity; GPU driver against torch's CUDA, persistence and compute
mode, ECC, clocks, topology, NCCL; the network interface, RDMA devices and NCCL/hvps interface
settings; software versions; and whether it runs in a container. Each row gives the value
found, a verdict (ok, warn, fail; skip where a check does not apply, e.g. no GPU), why it
matters, and the fix.

    hvps doctor                          # this node
    hvps doctor --json --output dr.json
    hvpsrun -np 8 -H a:4,b:4 --doctor    # every rank; rank 0 prints one table, flags mismatches
    hvps doctor --apply thp --yes        # safe, recorded changes; undo with --revert
"""

EPILOG = """\
exit status: 0 when no check fails (warnings allowed); 1 when a check fails, or an --apply or
--revert step fails; 2 for bad usage, a refused or declined --apply, or a refused --revert record
(one not owned by this user, writable by group or others, or naming anything but the settings
--apply changes).
--apply refuses, with the reason, the seed's unsafe advice: rt-priority (chrt -f 99 for training)
and min-granularity (kernel.sched_min_granularity_ns=99).
"""


def run(args: argparse.Namespace) -> int:
    from . import apply as applying
    from .host import Host
    from .report import as_json, as_table
    from .runner import all_ranks_report, local_report

    if args.all_ranks and (args.apply is not None or args.revert):
        print("hvps doctor: --apply and --revert change one node and may prompt; run them on each node "
              "without --all-ranks", file=sys.stderr)
        return 2
    if args.apply is not None or args.revert:
        host = Host(args.root)
        try:
            state = Path(args.state) if args.state else applying.default_state_path(host)
        except PermissionError as exc:  # the tree's var/lib/hvps leads out of --root
            print(f"hvps doctor: {exc}; give --state", file=sys.stderr)
            return 2
        if args.revert:
            return applying.revert(host, state)
        names = [n.strip() for n in args.apply.split(",") if n.strip()]
        return applying.apply(host, names, state, args.yes)
    try:
        report = (all_ranks_report if args.all_ranks else local_report)(args.root, args.ranks_per_node, args.only)
    except ValueError as exc:
        print(f"hvps doctor: {exc}", file=sys.stderr)
        return 2
    if args.all_ranks:
        from mpi4py import MPI

        status = MPI.COMM_WORLD.bcast(report["exit_status"] if report else None, root=0)
        if report is None:
            return status
    text = as_json(report) if args.json else as_table(report, args.verbose)
    if args.output:
        Path(args.output).write_text(text + "\n")
    else:
        sys.stdout.write(text + "\n")
        sys.stdout.flush()
    return report["exit_status"]


def register(sub) -> None:
    from .apply import ACTIONS, REFUSED

    p = sub.add_parser("doctor", help="preflight check of this node (or every node under mpirun) for training",
                       description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", action="store_true", help="print the report as JSON (every field of every check)")
    p.add_argument("--output", metavar="PATH", help="write the report to PATH instead of stdout (under mpirun: "
                   "no launcher tags in the file)")
    p.add_argument("-v", "--verbose", action="store_true", help="also print why each ok check matters")
    p.add_argument("--only", metavar="GROUP[,...]", help="run only these groups (cpu, memory, gpu, network, "
                   "software, container) or check names, e.g. --only gpu,net.interface")
    p.add_argument("--all-ranks", action="store_true", help="run on every rank of an MPI job (start it with "
                   "hvpsrun/mpirun); rank 0 prints one table with per-rank values: differing versions (hvps, "
                   "torch, TF, MPI, NCCL, GPU driver) fail, differing node settings (governor, SMT, THP, "
                   "scheduler granularity) warn")
    p.add_argument("--ranks-per-node", type=positive, metavar="N", help="ranks that will share this node "
                   "(sizes the shm, cgroup and SMT checks); default: counted under --all-ranks, else 1")
    p.add_argument("--root", default="/", metavar="DIR", help="read /proc, /sys, /etc and /dev/shm from a "
                   "prepared tree instead of this machine; non-file facts (ulimits, shm size, scheduling, env, "
                   "addresses, versions, GPUs) come from DIR/hvps-doctor-facts.json. '{rank}' in DIR is "
                   "replaced by the MPI rank under --all-ranks. Default: /")
    p.add_argument("--apply", nargs="?", const="all", metavar="ACTION[,...]",
                   help=f"make safe, reversible changes: {', '.join(f'{a.name} ({a.summary})' for a in ACTIONS.values())}; "
                        f"no value: all of them. Asks first; records each change in the state file. Refused "
                        f"with the reason: {', '.join(REFUSED)}")
    p.add_argument("--revert", action="store_true", help="undo the changes recorded in the state file, newest first")
    p.add_argument("--yes", action="store_true", help="with --apply: do not ask")
    p.add_argument("--state", metavar="PATH", help="the --apply/--revert state file; default "
                   "/var/lib/hvps/doctor-state.json as root, else ~/.local/state/hvps/doctor-state.json "
                   "($XDG_STATE_HOME), or inside the tree under --root")
    p.set_defaults(func=run)
