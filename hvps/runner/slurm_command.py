"""Inside a Slurm allocation: which launcher works here, and the ``srun --mpi=pmix`` line.

Slurm can start the ranks itself (``srun --mpi=pmix``, "direct launch") only when its
PMIx plugin loads on the node: ``srun --mpi=list`` must list ``pmix``, and even then
the plugin can fail at init when the PMIx library it was built against is missing
(Debian's ``slurm-wlm`` without ``libpmix``: "Couldn't load specified plugin name for
mpi/pmix: Plugin init() callback failed"). So :func:`probe_pmix` checks the list and
then runs one cheap step, ``srun --mpi=pmix -N1 -n1 printenv PMIX_RANK``, which must
print the rank Slurm's PMIx server gave it. When the plugin is unusable, ``mpirun``
run inside the allocation reads the nodes and slots from Slurm's environment and
starts its daemons with Slurm's own tools (Open MPI's recommended way under Slurm).

``python -m hvps.runner.slurm_command`` prints the choice (``srun`` or ``mpirun``) on
stdout and the reason on stderr, for batch scripts (jobs/common.sh).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

from . import hosts as hostlib
from .errors import LaunchError
from .mpi_command import rank_environment
from .mpi_transport import shared_memory_btls, single_node_allocation
from .settings import LAUNCHERS, LaunchSettings

#: seconds each probe command may take (a step normally starts in well under a second)
PMIX_PROBE_TIMEOUT = 30.0
#: the probe step: one task under the pmix plugin, printing the PMIx rank Slurm's server assigned
PMIX_PROBE_STEP = ("--mpi=pmix", "-N1", "-n1", "--quiet", "printenv", "PMIX_RANK")

_SRUN_ERROR = re.compile(r"^srun: (?:error|fatal):\s*")


def in_slurm_allocation(env: Mapping[str, str]) -> bool:
    """Whether we run inside a Slurm job (batch script or salloc shell)."""
    return bool(env.get("SLURM_JOB_ID"))


@dataclass(frozen=True)
class PmixProbe:
    """Whether ``srun --mpi=pmix`` can start ranks here, and one line saying why."""

    usable: bool
    reason: str


def listed_mpi_plugins(output: str) -> tuple:
    """The plugin names in ``srun --mpi=list`` output.

    Slurm >= 21.08 prints ``MPI plugin types are...`` then one indented name per line;
    older releases print ``srun: MPI types are...`` then ``srun: <name>`` lines.
    """
    names = []
    for line in output.splitlines():
        word = line.strip()
        if word.startswith("srun:"):
            word = word[len("srun:"):].strip()
        if re.fullmatch(r"[A-Za-z0-9_.-]+", word):
            names.append(word)
    return tuple(names)


def srun_failure(output: str, returncode: Optional[int]) -> str:
    """The most telling line of a failed srun: its first error about a plugin, else its first error."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [_SRUN_ERROR.sub("", line) for line in lines if _SRUN_ERROR.match(line)] or lines
    about_plugin = [line for line in errors if "plugin" in line.lower()]
    if about_plugin or errors:
        return (about_plugin or errors)[0]
    return f"exit status {returncode}"


def list_verdict(returncode: int, output: str) -> Optional[PmixProbe]:
    """From ``srun --mpi=list``: a failed probe when pmix is not listed, None to go on probing."""
    if returncode != 0:
        return PmixProbe(False, f"srun --mpi=list failed: {srun_failure(output, returncode)}")
    plugins = listed_mpi_plugins(output)
    if not any(name == "pmix" or name.startswith("pmix_") for name in plugins):
        return PmixProbe(False, f"srun --mpi=list does not list pmix (it lists: {', '.join(plugins) or 'nothing'})")
    return None


def step_verdict(returncode: int, stdout: str, stderr: str) -> PmixProbe:
    """From the probe step (:data:`PMIX_PROBE_STEP`): usable only when it printed PMIx rank 0."""
    if returncode == 0 and stdout.strip() == "0":
        return PmixProbe(True, "srun --mpi=list lists pmix and a probe step got PMIx rank 0")
    if returncode == 0 or not (stdout + stderr).strip():
        return PmixProbe(False, "a probe step under --mpi=pmix ran without a PMIx environment (PMIX_RANK unset)")
    return PmixProbe(False, f"a probe step failed: {srun_failure(stderr + stdout, returncode)}")


def _run(run: Callable, argv: list, env: Mapping[str, str], timeout: float) -> subprocess.CompletedProcess:
    return run(argv, env=dict(env), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
               text=True, timeout=timeout)


def probe_pmix(env: Mapping[str, str], run: Callable = subprocess.run,
               timeout: float = PMIX_PROBE_TIMEOUT) -> PmixProbe:
    """Can ``srun --mpi=pmix`` start ranks in this allocation? ``srun --mpi=list``, then one probe step.

    ``run`` has :func:`subprocess.run`'s signature (injectable for tests); each command
    gets ``timeout`` seconds.
    """
    srun = shutil.which("srun", path=env.get("PATH"))
    if srun is None:
        return PmixProbe(False, "srun is not on PATH")
    try:
        listed = _run(run, [srun, "--mpi=list"], env, timeout)
        verdict = list_verdict(listed.returncode, (listed.stdout or "") + (listed.stderr or ""))
        if verdict is not None:
            return verdict
        step = _run(run, [srun, *PMIX_PROBE_STEP], env, timeout)
    except subprocess.TimeoutExpired as exc:
        shown = shlex.join(["srun", *list(exc.cmd)[1:]])
        return PmixProbe(False, f"'{shown}' did not finish within {timeout:g} s")
    except OSError as exc:
        return PmixProbe(False, f"cannot run {srun}: {exc.strerror or exc}")
    return step_verdict(step.returncode, step.stdout or "", step.stderr or "")


def decide_slurm_launcher(requested: str, env: Mapping[str, str],
                          probe: Callable[[Mapping[str, str]], PmixProbe] = probe_pmix) -> tuple:
    """``('srun' | 'mpirun', line)`` inside a Slurm allocation; ``line`` says which and why, for the job log.

    ``requested`` is hvpsrun's ``--launcher``: ``srun`` and ``mpirun`` are taken as given,
    ``auto`` takes srun only when :func:`probe_pmix` finds the pmix plugin usable.
    """
    job = f"Slurm job {env.get('SLURM_JOB_ID')}"
    if requested == "srun":
        return "srun", f"{job}: srun --mpi=pmix (--launcher srun; pmix not probed)"
    if requested == "mpirun":
        return "mpirun", f"{job}: mpirun inside the allocation (--launcher mpirun)"
    result = probe(env)
    if result.usable:
        return "srun", f"{job}: srun --mpi=pmix ({result.reason})"
    return "mpirun", (f"{job}: srun's pmix plugin is unusable here ({result.reason}); "
                      "launching with mpirun inside the allocation")


def _int(env: Mapping[str, str], name: str) -> Optional[int]:
    raw = env.get(name, "")
    head = raw.split("(")[0].split(",")[0]  # SLURM_TASKS_PER_NODE looks like '2(x3),1'
    return int(head) if head.isdigit() else None


def allocation_num_proc(env: Mapping[str, str]) -> Optional[int]:
    return _int(env, "SLURM_NTASKS") or _int(env, "SLURM_NPROCS")


def build_srun_command(settings: LaunchSettings, env: Mapping[str, str], *, cpu_count: int = 1,
                       srun: str = "srun") -> list:
    """``srun --mpi=pmix -n N ...`` for the current allocation.

    ``--kill-on-bad-exit=1`` makes Slurm end the other ranks when one fails, as
    mpirun does; ``--cpu-bind=none`` matches mpirun's ``-bind-to none``. srun
    exports the whole environment by default, so the HVPS_* variables reach the
    ranks without flags; hvpsrun runs srun with :func:`srun_environment`.
    """
    if not settings.command:
        raise LaunchError("no command given; e.g. hvpsrun -np 2 python train.py")
    hosts = hostlib.resolve_hosts(settings.hosts, settings.hostfile)
    num_proc = settings.num_proc or allocation_num_proc(env) or (sum(h.slots for h in hosts) if hosts else None)
    if num_proc is None:
        raise LaunchError("-np is required: the allocation does not say how many tasks (SLURM_NTASKS is unset)")
    allocated = allocation_num_proc(env)
    if allocated is not None and num_proc > allocated and not hosts:
        raise LaunchError(f"-np {num_proc} is more than the {allocated} tasks of Slurm job {env.get('SLURM_JOB_ID')};"
                          " lower -np or submit with more tasks (sbatch -n)")
    cmd = [srun, "--mpi=pmix", "-n", str(num_proc), "--cpu-bind=none", "--kill-on-bad-exit=1"]
    if hosts:
        hostlib.check_slots(hosts, num_proc)
        per_host = [n for n in hostlib.ranks_per_host(hosts, num_proc) if n]
        used = hosts[: len(per_host)]
        cmd += ["--nodes", str(len(used)), "--nodelist", ",".join(h.name for h in used)]
        if len(set(per_host)) == 1:
            cmd += ["--ntasks-per-node", str(per_host[0])]
    return cmd + shlex.split(settings.mpi_args) + list(settings.command)


def srun_environment(settings: LaunchSettings, env: Mapping[str, str], num_proc: int, cpu_count: int) -> dict:
    """The environment srun runs with: the caller's plus HVPS_*, OMP_NUM_THREADS and NIC selection."""
    full = dict(env)
    tasks_per_node = _int(env, "SLURM_TASKS_PER_NODE") or num_proc
    cpus_per_task = _int(env, "SLURM_CPUS_PER_TASK")
    if not env.get("OMP_NUM_THREADS") and cpus_per_task:
        full["OMP_NUM_THREADS"] = str(cpus_per_task)
    own = rank_environment(settings, full, tasks_per_node, [], cpu_count)
    full.update(own)
    if single_node_allocation(env):  # no TCP BTL listener on one node; 5.x takes vader as sm's alias
        full.setdefault("OMPI_MCA_btl", shared_memory_btls((4, 1)))
    if settings.network_interfaces:
        nics = ",".join(settings.network_interfaces)
        full.setdefault("OMPI_MCA_btl_tcp_if_include", nics)
        full.setdefault("OMPI_MCA_oob_tcp_if_include", nics)
    return full


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``python -m hvps.runner.slurm_command [--launcher auto|srun|mpirun]``: ``srun`` or ``mpirun`` on stdout."""
    parser = argparse.ArgumentParser(
        prog="python -m hvps.runner.slurm_command",
        description="Inside a Slurm allocation, print the launcher for the ranks (srun or mpirun) on stdout "
                    "and one line on stderr saying why: srun --mpi=pmix when its plugin works here, "
                    "mpirun inside the allocation otherwise.")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="auto",
                        help="auto (default): probe pmix; srun or mpirun: take that one")
    args = parser.parse_args(argv)
    if not in_slurm_allocation(os.environ):
        print("hvps: not inside a Slurm allocation (SLURM_JOB_ID is unset)", file=sys.stderr)
        return 2
    launcher, line = decide_slurm_launcher(args.launcher, os.environ)
    print(f"hvps: {line}", file=sys.stderr, flush=True)
    print(launcher)
    return 0


if __name__ == "__main__":
    sys.exit(main())
