"""What hvps knows about each launcher, in one table: the MPI implementations and the others.

**MPI implementations.** :class:`MpiImpl` is the table: one member per implementation, each a
frozen :class:`MpiSpec` that says how ``mpirun --version`` (and ``MPI_Get_library_version``) names
it and its version, the rank variables its launcher sets, and the flags of its command line.
Everything else reads the table: :mod:`hvps.runner.mpi_discovery` (which mpirun, what it is),
:mod:`hvps.runner.mpi_command` (the command line), :mod:`hvps.runtime.bootstrap` (was this
process started by MPI), the doctor (which MPI a rank loads) and the metrics (which rank am I).
A new implementation is one new member here (and its unit tests); nothing else changes.
Horovod keeps the same knowledge in ``horovod/runner/mpi_run.py``.

**Rank variables.** :func:`launcher_rank` reads rank, size, local rank and local size from the
environment a launcher gave this process, before ``hvps.init()`` (benchmarks, test helpers,
metric labels). The launchers are tried in :data:`RANK_VARIABLES`' order and one launcher gives
all four numbers: MPI launchers first (a job started by mpirun inside a Slurm batch step
inherits the step's ``SLURM_PROCID=0``), then hvpsrun --gloo's Horovod variables, torchrun's,
Slurm's srun, and last PMIx's ``PMIX_RANK``, which names no size.
"""

from __future__ import annotations

import enum
import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional, Tuple


@dataclass(frozen=True)
class RankVariables:
    """The variables one launcher sets for each process it starts ("" when it sets none)."""

    launcher: str
    rank: str
    size: str = ""
    local_rank: str = ""
    local_size: str = ""

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(n for n in (self.rank, self.size, self.local_rank, self.local_size) if n)


@dataclass(frozen=True)
class MpiSpec:
    """One MPI implementation: how to recognise it, how to start it, what its ranks see.

    Command-line fields hold the implementation's own spelling; an empty one means it has no such
    flag (hvpsrun then does without). They are read by :func:`hvps.runner.mpi_command.build_mpirun_command`.
    """

    #: as hvps names it in messages ("Open MPI 5.0.11")
    name: str
    #: substrings of ``mpirun --version`` or ``MPI_Get_library_version`` output that only this MPI prints
    markers: Tuple[str, ...] = ()
    #: regular expressions whose first group is the dotted version, tried in order
    version_patterns: Tuple[str, ...] = ()
    #: the variables its launcher sets in every rank
    ranks: Optional[RankVariables] = None
    #: the launcher hvpsrun starts, looked for beside the ``mpirun`` found ("mpirun": that one)
    executable: str = "mpirun"
    #: the number of processes
    np_flag: str = "-np"
    #: prefix every output line with its rank
    label_output: Tuple[str, ...] = ()
    #: no core binding and slot-wise mapping (the engine thread needs cores beside training)
    no_binding: Tuple[str, ...] = ()
    #: given when hvpsrun runs as root (Open MPI refuses root without it)
    run_as_root: Tuple[str, ...] = ()
    #: given when a one-host job has more ranks than cores
    oversubscribe: Tuple[str, ...] = ()
    #: hosts with their slots, ``FLAG a:2,b:1``
    hosts_flag: str = ""
    #: hosts without slots and one slot count for all, ``HOSTS a,b PPN 2`` (used when hosts_flag is "")
    hostnames_flag: str = ""
    ppn_flag: str = ""
    #: a hostfile (how hvpsrun passes IPv6 literals, from ipv6_since on)
    hostfile_flag: str = ""
    #: the first version whose launcher takes IPv6 host literals (in a hostfile); None: no version does
    ipv6_since: Optional[Tuple[int, ...]] = None
    #: forward variables by name: one ``FLAG NAME`` per variable (env_each), or one comma list (env_list)
    env_each: str = ""
    env_list: str = ""
    #: the interface the launcher's own connections use (the first --network-interface)
    iface_flag: str = ""
    #: Open MPI's MCA transport choice: the TCP BTL off on one host, bound to --network-interface across hosts
    #: (:func:`hvps.runner.mpi_transport.open_mpi_transport_args`)
    mca_transport: bool = False

    def __str__(self) -> str:
        return self.name

    @property
    def known(self) -> bool:
        """Whether this is an implementation hvpsrun can launch (not UNKNOWN or MISSING)."""
        return bool(self.markers)


_DOTTED = r"(\d+(?:\.\d+)*)"

#: MPICH's Hydra and Intel MPI's (built on it) set the same variables
HYDRA_RANKS = RankVariables("Hydra", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")


class MpiImpl(enum.Enum):
    """The table of MPI implementations, most specific first (its order is the order they are recognised in)."""

    OPEN_MPI = MpiSpec(
        name="Open MPI",
        markers=("Open MPI", "OpenRTE"),
        version_patterns=(r"\(Open MPI\)\s+" + _DOTTED, r"Open MPI v?" + _DOTTED),
        ranks=RankVariables("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                            "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"),
        # 4.1 and 5.x both take the double-dash forms; 5.x's prterun rejects '-bind-to'
        no_binding=("--bind-to", "none", "--map-by", "slot"),
        label_output=("--tag-output",),
        run_as_root=("--allow-run-as-root",),
        oversubscribe=("--oversubscribe",),
        hosts_flag="-H",
        hostfile_flag="--hostfile",
        ipv6_since=(5,),
        env_each="-x",
        mca_transport=True,
    )
    INTEL_MPI = MpiSpec(  # before MPICH: its launcher is MPICH's Hydra too
        name="Intel MPI",
        markers=("Intel(R) MPI",),
        version_patterns=(r"Version\s+" + _DOTTED, r"Intel\(R\) MPI Library\s+" + _DOTTED),
        ranks=HYDRA_RANKS,
        executable="mpiexec.hydra",  # what its mpirun script runs
        np_flag="-n",
        label_output=("-l",),
        hostnames_flag="-hosts",  # -hosts a,b -ppn 2: no per-host slots (pinning: I_MPI_PIN)
        ppn_flag="-ppn",
        env_list="-genvlist",  # names only; its -genv NAME VALUE would put values on the command line
        iface_flag="-iface",
    )
    MPICH = MpiSpec(
        name="MPICH",
        markers=("HYDRA", "MPICH"),
        version_patterns=(r"Version:\s+" + _DOTTED,),
        ranks=HYDRA_RANKS,
        label_output=("-l",),
        no_binding=("-bind-to", "none", "-map-by", "slot"),
        hosts_flag="-hosts",
        env_list="-genvlist",
        iface_flag="-iface",
    )
    UNKNOWN = MpiSpec(name="unknown")
    MISSING = MpiSpec(name="missing")

    @property
    def spec(self) -> MpiSpec:
        return self.value

    @property
    def label(self) -> str:
        return self.value.name


#: variables an MPI launcher sets in its ranks (PMIx: Open MPI 5's and srun --mpi=pmix's)
MPI_LAUNCH_VARIABLES: Tuple[str, ...] = tuple(dict.fromkeys(
    [name for impl in MpiImpl if impl.spec.ranks for name in impl.spec.ranks.names] + ["PMIX_RANK"]))


def version_text(version: tuple) -> str:
    """``(5, 0, 11)`` as ``5.0.11``; "version unknown" for ()."""
    return ".".join(map(str, version)) or "version unknown"


def classify_mpi_version(output: str) -> MpiImpl:
    """The implementation that printed this ``mpirun --version`` (or library version) text."""
    for impl in MpiImpl:
        if any(marker in output for marker in impl.spec.markers):
            return impl
    return MpiImpl.UNKNOWN


def parse_mpi_version(output: str) -> Tuple[MpiImpl, tuple]:
    """``(implementation, (major, minor, ...))`` from ``mpirun --version`` or ``MPI_Get_library_version``
    text; the version is () when none is found."""
    impl = classify_mpi_version(output)
    for pattern in impl.spec.version_patterns:
        match = re.search(pattern, output)
        if match:
            return impl, tuple(int(part) for part in match.group(1).split("."))
    return impl, ()


# ----------------------------------------------------------------------------- rank variables

#: every launcher's variables, in the order they are believed (see the module's docstring)
RANK_VARIABLES: Tuple[RankVariables, ...] = tuple(dict.fromkeys(
    [impl.spec.ranks for impl in MpiImpl if impl.spec.ranks] + [
        RankVariables("Horovod", "HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE"),
        RankVariables("torchrun", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"),
        RankVariables("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
        RankVariables("PMIx", "PMIX_RANK"),
    ]))


@dataclass(frozen=True)
class LauncherRank:
    """Where this process stands in its job, as its launcher said (None: that launcher does not say)."""

    launcher: str
    rank: int
    size: Optional[int] = None
    local_rank: Optional[int] = None
    local_size: Optional[int] = None


def _number(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name, "").strip() if name else ""
    return int(value) if value.isdigit() else None


def launcher_rank(env: Optional[Mapping[str, str]] = None) -> Optional[LauncherRank]:
    """Rank, size, local rank and local size from the first launcher in :data:`RANK_VARIABLES` whose
    rank variable is set here; None when no launcher started this process."""
    env = os.environ if env is None else env
    for names in RANK_VARIABLES:
        rank = _number(env, names.rank)
        if rank is not None:
            return LauncherRank(names.launcher, rank, _number(env, names.size), _number(env, names.local_rank),
                                _number(env, names.local_size))
    return None


def env_rank(env: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank as its launcher said; 0 when none did."""
    found = launcher_rank(env)
    return found.rank if found else 0


def env_size(env: Optional[Mapping[str, str]] = None) -> int:
    """The job's size as the launcher said; 1 when none did (or it names no size)."""
    found = launcher_rank(env)
    return found.size if found and found.size else 1


def env_local_rank(env: Optional[Mapping[str, str]] = None) -> int:
    """This process's rank on its host as the launcher said; 0 when none did."""
    found = launcher_rank(env)
    return found.local_rank if found and found.local_rank is not None else 0
