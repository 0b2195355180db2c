"""``hvpsrun``: parse flags, check the input, build the mpirun/srun line, run it under the supervisor."""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from typing import Mapping, Optional, Sequence

from . import hosts as hostlib
from .check_build import check_build
from .errors import LaunchError
from .mpi_command import (
    MISSING_MPI,
    build_mpirun_command,
    default_num_proc,
    detect_mpi_implementation,
    launch_environment,
)
from .settings import LaunchSettings, parse_args
from .slurm_command import allocation_num_proc, build_srun_command, in_slurm_allocation, srun_environment
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


def choose_launcher(settings: LaunchSettings, env: Mapping[str, str]) -> str:
    if settings.launcher != "auto":
        return settings.launcher
    if in_slurm_allocation(env) and shutil.which("srun"):
        return "srun"
    return "mpirun"


def prepare(settings: LaunchSettings, env: Mapping[str, str], cpu_count: Optional[int] = None) -> tuple:
    """Check the input and return ``(argv, launch_env)``; raises LaunchError for bad input."""
    cpu_count = cpu_count or os.cpu_count() or 1
    check_command(settings.command, os.getcwd())
    env = dict(env)
    env.setdefault(RESTART_ENV, "0")  # forwarded by name, so each restart's value reaches the ranks
    launcher = choose_launcher(settings, env)
    hosts = hostlib.resolve_hosts(settings.hosts, settings.hostfile)
    hostlib.check_resolvable(hosts)
    if launcher == "srun":
        if shutil.which("srun") is None:
            raise LaunchError("--launcher srun: srun is not on PATH; run inside a Slurm installation")
        cmd = build_srun_command(settings, env, cpu_count=cpu_count)
        num_proc = settings.num_proc or allocation_num_proc(env) or 1
        return cmd, srun_environment(settings, env, num_proc, cpu_count)
    mpirun = shutil.which(settings.mpirun)
    if mpirun is None:
        raise LaunchError(MISSING_MPI.format(mpirun=settings.mpirun))
    impl = detect_mpi_implementation(settings.mpirun)
    cmd = build_mpirun_command(settings, env, impl=impl, hosts=hosts, cpu_count=cpu_count)
    num_proc = default_num_proc(settings, hosts)
    return cmd, launch_environment(settings, env, num_proc, hosts, cpu_count)


def main(argv: Optional[Sequence[str]] = None) -> int:
    try:
        settings = parse_args(argv)
        if settings.check_build:
            sys.stdout.write(check_build(settings.mpirun))
            return 0
        cmd, env = prepare(settings, os.environ)
    except LaunchError as exc:
        print(f"hvpsrun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    if settings.dry_run:
        print(shlex.join(cmd))
        return 0
    if settings.verbose:
        print(f"hvpsrun: {shlex.join(cmd)}", file=sys.stderr, flush=True)
    supervisor = Supervisor(cmd, env, max_restarts=settings.max_restarts, checkpoint_dir=settings.checkpoint_dir,
                            verbose=settings.verbose)
    try:
        rc = supervisor.run()
    except OSError as exc:
        print(f"hvpsrun: error: cannot start {cmd[0]}: {exc.strerror}", file=sys.stderr)
        return 2
    return exit_status(rc)


if __name__ == "__main__":
    sys.exit(main())
