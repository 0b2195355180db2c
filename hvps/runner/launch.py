"""``hvpsrun``: parse flags, check the input, build the mpirun/srun line, run it under the supervisor."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shlex
import shutil
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Sequence

from ..core.mpi_env import mpi_defaults
from . import gloo_run
from . import hosts as hostlib
from .check_build import check_build
from .errors import LaunchError
from .mpi_command import build_mpirun_command, default_num_proc, launch_environment, split_mpi_args
from .mpi_discovery import check_mpi4py, find_mpirun
from .mpi_transport import exposure_warning, single_node_allocation
from .settings import LaunchSettings, parse_args
from .slurm_command import (
    PmixProbe,
    allocation_num_proc,
    build_srun_command,
    decide_slurm_launcher,
    in_slurm_allocation,
    probe_pmix,
    srun_environment,
)
from .supervisor import RESTART_ENV, Supervisor, exit_status

_PYTHON_FLAGS_WITH_VALUE = {"-W", "-X", "-Q"}


def check_command(command: Sequence[str], cwd: Optional[str] = None) -> None:
    """The program must exist; for ``python script.py`` the script must exist too."""
    if not command:
        raise LaunchError("no command given; e.g. hvpsrun -np 2 python train.py")
    program = command[0]
    if os.sep in program:
        if not os.path.exists(program):
            raise LaunchError(f"program '{program}' not found; check the path")
    elif shutil.which(program) is None:
        raise LaunchError(f"program '{program}' is not on PATH; give its full path or activate its environment")
    if os.path.basename(program).startswith("python"):
        args = iter(command[1:])
        for arg in args:
            if arg in ("-m", "-c") or arg.startswith(("-m", "-c")) or arg == "-":
                return
            if arg in _PYTHON_FLAGS_WITH_VALUE:
                next(args, None)
                continue
            if arg.startswith("-"):
                continue
            path = arg if os.path.isabs(arg) or cwd is None else os.path.join(cwd, arg)
            if not os.path.isfile(path):
                raise LaunchError(f"script '{arg}' not found in {cwd or os.getcwd()}; give a path relative to the "
                                  "working directory or an absolute one")
            return
    elif program.endswith(".py") and not os.path.isfile(program):
        raise LaunchError(f"script '{program}' not found; check the path")


def choose_launcher(settings: LaunchSettings, env: Mapping[str, str],
                    probe: Callable[[Mapping[str, str]], PmixProbe] = probe_pmix) -> str:
    """``srun`` or ``mpirun``. Outside Slurm: mpirun unless --launcher says otherwise. Inside a
    Slurm allocation, auto takes ``srun --mpi=pmix`` only when ``probe`` finds its plugin usable,
    else mpirun inside the allocation; one line on stderr says which and why (for the job log)."""
    if not in_slurm_allocation(env):
        return "mpirun" if settings.launcher == "auto" else settings.launcher
    launcher, line = decide_slurm_launcher(settings.launcher, env, probe)
    print(f"hvpsrun: {line}", file=sys.stderr, flush=True)
    return launcher


@dataclass
class Launch:
    """What to run: the launcher's argv and environment, and what hvpsrun set in it."""

    argv: list
    env: dict
    assigned: dict = field(default_factory=dict)  # variables hvpsrun set for the ranks (shown by --dry-run)
    note: str = ""  # one line on which launcher was taken, for --verbose
    temp_files: list = field(default_factory=list)
    preview: str = ""  # what --dry-run shows instead of the shell line (hvpsrun --gloo: the workers' lines)

    def shell_line(self) -> str:
        """The command as a shell line: ``VAR=value ... mpirun ...``."""
        if self.preview:
            return self.preview
        return shlex.join([f"{k}={v}" for k, v in sorted(self.assigned.items())] + self.argv)

    def cleanup(self) -> None:
        for path in self.temp_files:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _assigned(full: Mapping[str, str], env: Mapping[str, str]) -> dict:
    """The variables of ``full`` that hvpsrun added or changed relative to the caller's ``env``."""
    return {k: v for k, v in full.items() if env.get(k) != v}


def _ipv6_hostfile(hosts: list) -> str:
    fd, path = tempfile.mkstemp(prefix="hvpsrun-hosts-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(hostlib.hostfile_text(hosts))
    return path


def prepare(settings: LaunchSettings, env: Mapping[str, str], cpu_count: Optional[int] = None) -> Launch:
    """Check the input and work out what to run; raises LaunchError for bad input."""
    cpu_count = cpu_count or os.cpu_count() or 1
    check_command(settings.command, os.getcwd())
    split_mpi_args(settings.mpi_args)
    env = dict(env)
    env.setdefault(RESTART_ENV, "0")  # forwarded by name, so each restart's value reaches the ranks
    if settings.gloo or settings.elastic:
        return _prepare_gloo(settings, env, cpu_count)
    check_mpi4py()
    launcher = choose_launcher(settings, env)
    hosts = hostlib.resolve_hosts(settings.hosts, settings.hostfile)
    hostlib.check_resolvable(hosts)
    if launcher == "srun":
        if shutil.which("srun") is None:
            raise LaunchError("--launcher srun: srun is not on PATH; run inside a Slurm installation")
        cmd = build_srun_command(settings, env, cpu_count=cpu_count)
        num_proc = settings.num_proc or allocation_num_proc(env) or 1
        full = srun_environment(settings, env, num_proc, cpu_count)
        return Launch(cmd, full, _assigned(full, env), "srun")
    mpi = find_mpirun(settings.mpirun, env)
    in_allocation = in_slurm_allocation(env) and not hosts
    if in_allocation:  # mpirun reads the nodes and slots from Slurm's environment
        settings = dataclasses.replace(settings, num_proc=settings.num_proc or allocation_num_proc(env))
    num_proc = default_num_proc(settings, hosts)
    temp_files = []
    if mpi.impl.spec.hostfile_flag and any(h.is_ipv6 for h in hosts):  # IPv6 literals travel in a hostfile
        temp_files.append(_ipv6_hostfile(hosts))
    cmd = build_mpirun_command(settings, env, mpi=mpi, hosts=hosts, cpu_count=cpu_count, in_allocation=in_allocation,
                               hostfile=temp_files[0] if temp_files else None)
    one_host = single_node_allocation(env) if in_allocation else hostlib.is_local_only(hosts)
    warning = mpi.impl.spec.mca_transport and exposure_warning(one_host, settings.network_interfaces,
                                                                split_mpi_args(settings.mpi_args), env)
    if warning:
        print(f"hvpsrun: warning: {warning}", file=sys.stderr, flush=True)
    if in_allocation:  # threads per rank from the allocation's tasks per node, as for srun
        full = dict(mpi_defaults(srun_environment(settings, env, num_proc, cpu_count)))
    else:
        full = launch_environment(settings, env, num_proc, hosts, cpu_count)
    return Launch(cmd, full, _assigned(full, env), mpi.describe(), temp_files)


def _prepare_gloo(settings: LaunchSettings, env: dict, cpu_count: int) -> Launch:
    """``hvpsrun --gloo`` and elastic mode: the job process (:mod:`hvps.runner.gloo_run`, or the elastic
    driver :mod:`hvps.runner.elastic_run`) runs from a plan file."""
    plan = gloo_run.build_plan(settings, env, cpu_count)
    fd, path = tempfile.mkstemp(prefix="hvpsrun-gloo-", suffix=".json")
    os.close(fd)
    plan.save(path)
    if plan.elastic:
        if settings.max_restarts:
            raise LaunchError("--max-restarts restarts the whole job; elastic mode recovers in place (--reset-limit "
                              "bounds its resets): drop --max-restarts")
        note = f"elastic: at least {plan.elastic['min_np']} workers, started by hvpsrun, no MPI"
        return Launch([sys.executable, "-m", "hvps.runner.elastic_run", path], env, dict(plan.env), note, [path],
                      f"# elastic driver, membership from {plan.elastic['discovery_script'] or '-H'}\n"
                      + gloo_run.preview(plan))
    note = f"--gloo: {plan.num_proc} workers started by hvpsrun, no MPI"
    return Launch([sys.executable, "-m", "hvps.runner.gloo_run", path], env, dict(plan.env), note, [path],
                  gloo_run.preview(plan))


#: what ``hvpsrun --doctor`` runs on every rank
DOCTOR_COMMAND = (sys.executable, "-m", "hvps.doctor", "--all-ranks")


def run_doctor(settings: LaunchSettings) -> int:
    """``hvps doctor --all-ranks`` with the job's launcher, hosts and rank count; its exit status."""
    launch = prepare(dataclasses.replace(settings, command=DOCTOR_COMMAND, max_restarts=0), os.environ)
    if settings.dry_run:
        print(launch.shell_line())
        return 0
    try:
        rc = exit_status(Supervisor(launch.argv, launch.env, verbose=settings.verbose).run())
    finally:
        launch.cleanup()
    if rc and settings.command:
        print("hvpsrun: hvps doctor reported failures (exit status 1 means a check failed); not starting the job. "
              "Fix them, or run without --doctor", file=sys.stderr)
    return rc


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        settings = parse_args(argv)
        if settings.check_build:
            sys.stdout.write(check_build(settings.mpirun))
            return 0
        if settings.doctor:
            rc = run_doctor(settings)
            if rc or not settings.command:
                return rc
        launch = prepare(settings, os.environ)
    except LaunchError as exc:
        print(f"hvpsrun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if settings.dry_run:
        print(launch.shell_line())
        return 0
    if settings.verbose:
        print(f"hvpsrun: {launch.note}", file=sys.stderr, flush=True)
    supervisor = Supervisor(launch.argv, launch.env, max_restarts=settings.max_restarts,
                            checkpoint_dir=settings.checkpoint_dir, verbose=settings.verbose)
    try:
        rc = supervisor.run()
    except OSError as exc:
        print(f"hvpsrun: error: cannot start {launch.argv[0]}: {exc.strerror}", file=sys.stderr)
        return 2
    finally:
        launch.cleanup()
    return exit_status(rc)


if __name__ == "__main__":
    sys.exit(main())
