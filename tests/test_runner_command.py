"""hvpsrun's command building, flags and host parsing: pure functions, no MPI started."""

from __future__ import annotations

import dataclasses

import pytest

from hvps.runner import hosts as hostlib
from hvps.runner.errors import LaunchError
from hvps.runner.mpi_command import (
    build_mpirun_command,
    cores_per_rank,
    default_num_proc,
    launch_environment,
    split_mpi_args,
)
from hvps.core.launchers import MpiImpl, classify_mpi_version, parse_mpi_version
from hvps.runner.mpi_discovery import MpiLauncher
from hvps.runner.settings import LaunchSettings, build_parser, parse_args
from hvps.runner.slurm_command import build_srun_command, in_slurm_allocation, srun_environment

pytestmark = pytest.mark.unit

LOCAL = {"localhost", "127.0.0.1", "thisbox"}
CMD = ("python", "train.py")


def build(argv, env=None, impl=MpiImpl.OPEN_MPI, version=(5, 0, 11), **kw):
    settings = parse_args(argv)
    kw.setdefault("cpu_count", 8)
    kw.setdefault("euid", 1000)
    kw.setdefault("local_names", LOCAL)
    return build_mpirun_command(settings, env or {}, mpi=MpiLauncher("mpirun", "PATH", impl, version), **kw)


def rank_env(argv, env=None, cpu_count=8):
    """The environment the launcher runs with (what ``-x NAME`` forwards)."""
    settings = parse_args(argv)
    hosts = hostlib.resolve_hosts(settings.hosts, settings.hostfile)
    return launch_environment(settings, env or {}, default_num_proc(settings, hosts), hosts, cpu_count)


def pairs(cmd, flag):
    return [cmd[i + 1] for i, a in enumerate(cmd) if a == flag]


def test_open_mpi_defaults_single_node():
    cmd = build(["-np", "4", "python", "train.py"])
    assert cmd[:3] == ["mpirun", "-np", "4"]
    assert cmd[-2:] == list(CMD)
    i = cmd.index("--bind-to")  # Open MPI 5's prterun takes only the double-dash forms
    assert cmd[i:i + 4] == ["--bind-to", "none", "--map-by", "slot"]
    assert "-bind-to" not in cmd and "-mca" not in cmd
    assert "--allow-run-as-root" not in cmd and "--oversubscribe" not in cmd
    assert "-H" not in cmd
    assert "OMP_NUM_THREADS" in pairs(cmd, "-x")
    assert rank_env(["-np", "4", "python", "train.py"])["OMP_NUM_THREADS"] == "2"  # 8 cores / 4 ranks


def test_root_and_oversubscription():
    cmd = build(["-np", "3", "python", "train.py"], cpu_count=2, euid=0)
    assert "--allow-run-as-root" in cmd and "--oversubscribe" in cmd
    assert rank_env(["-np", "3", "python", "train.py"], cpu_count=2)["OMP_NUM_THREADS"] == "1"
    # remote hosts: mpirun maps by slots, no oversubscription flag
    cmd = build(["-np", "4", "-H", "a:2,b:2", "python", "train.py"], cpu_count=2, euid=0)
    assert "--oversubscribe" not in cmd


def test_forwards_hvps_nccl_omp_and_flag_values():
    env = {"HVPS_CYCLE_TIME": "3", "NCCL_DEBUG": "INFO", "OMP_NUM_THREADS": "5", "HOME": "/root", "SECRET": "x",
           "PYTHONPATH": "/src"}
    argv = ["-np", "2", "--fusion-threshold-mb", "32", "--cycle-time-ms", "2.5", "--stall-check-time-seconds", "5",
            "--timeline-filename", "/tmp/tl.json", "python", "train.py"]
    x = pairs(build(argv, env), "-x")
    assert not any("=" in v for v in x)  # names only: values travel in the environment, never on the line
    for name in ("HVPS_FUSION_THRESHOLD", "HVPS_CYCLE_TIME", "HVPS_STALL_CHECK_TIME_SECONDS", "HVPS_TIMELINE",
                 "NCCL_DEBUG", "OMP_NUM_THREADS", "PYTHONPATH"):
        assert x.count(name) == 1, name
    assert "HOME" not in x and "SECRET" not in x
    full = rank_env(argv, env)
    assert full["HVPS_FUSION_THRESHOLD"] == "33554432"
    assert full["HVPS_CYCLE_TIME"] == "2.5"  # the flag wins over the caller's HVPS_CYCLE_TIME
    assert full["HVPS_STALL_CHECK_TIME_SECONDS"] == "5" and full["HVPS_TIMELINE"] == "/tmp/tl.json"
    assert full["OMP_NUM_THREADS"] == "5"  # set by the user: kept


def test_launch_environment_gives_open_mpi_a_home():
    assert rank_env(["-np", "2", "python", "train.py"], {})["HOME"]  # Open MPI 5 fails in opal_init without it
    assert rank_env(["-np", "2", "python", "train.py"], {"HOME": "/h"})["HOME"] == "/h"


def test_backend_and_hierarchical_flags():
    argv = ["-np", "4", "--backend", "tdist", "--hierarchical-allreduce", "python", "train.py"]
    assert {"HVPS_BACKEND", "HVPS_HIERARCHICAL_ALLREDUCE"} <= set(pairs(build(argv, {}), "-x"))
    full = rank_env(argv)
    assert full["HVPS_BACKEND"] == "tdist" and full["HVPS_HIERARCHICAL_ALLREDUCE"] == "1"
    x = pairs(build(["-np", "4", "python", "train.py"], {}), "-x")
    assert not any(v.startswith(("HVPS_BACKEND", "HVPS_HIERARCHICAL")) for v in x)


def test_hosts_network_interface_and_mpi_args():
    argv = ["-np", "3", "-H", "n1:2,n2:1", "--network-interface", "eth1",
            "--mpi-args=--mca btl tcp,self --tag-output", "python", "train.py"]
    cmd = build(argv)
    assert pairs(cmd, "-H") == ["n1:2,n2:1"]
    assert pairs(cmd, "--mca")[:2] == ["btl_tcp_if_include", "oob_tcp_if_include"]
    assert "NCCL_SOCKET_IFNAME" in pairs(cmd, "-x")
    full = rank_env(argv)
    assert full["NCCL_SOCKET_IFNAME"] == "eth1" and full["HVPS_NETWORK_INTERFACE"] == "eth1"
    assert full["OMP_NUM_THREADS"] == "4"  # 8 cores, at most 2 ranks on a host
    tail = cmd[len(cmd) - 6:]
    assert tail == ["--mca", "btl", "tcp,self", "--tag-output", "python", "train.py"]


@pytest.mark.parametrize("text", ["'--mca btl", '--mca "a b', "x\\"])
def test_malformed_mpi_args_one_line(text):
    with pytest.raises(LaunchError, match="--mpi-args .*quote it once") as exc:
        split_mpi_args(text)
    assert "\n" not in str(exc.value)


def test_values_with_spaces_quotes_and_commas_stay_whole():
    script = "my dir/train, \"v2\".py"
    cmd = build(["-np", "2", "python", script, "--tag", "a,b c"], {"HVPS_NOTE": "x, 'y' \"z\""})
    assert cmd[-4:] == ["python", script, "--tag", "a,b c"]
    assert "HVPS_NOTE" in pairs(cmd, "-x")
    assert rank_env(["-np", "2", "python", script], {"HVPS_NOTE": "x, 'y'"})["HVPS_NOTE"] == "x, 'y'"


def test_ipv6_hosts():
    assert hostlib.parse_hosts("[::1]:2,[fe80::1%eth0]") == [hostlib.Host("::1", 2), hostlib.Host("fe80::1%eth0", 1)]
    assert hostlib.Host("::1", 2).spec() == "[::1]:2" and hostlib.Host("::1", 2).is_ipv6
    with pytest.raises(LaunchError, match="brackets"):
        hostlib.parse_hosts("::1:2")
    assert hostlib.parse_hostfile_text("[::1] slots=2\nfe80::2 slots=1\n") == [hostlib.Host("::1", 2),
                                                                             hostlib.Host("fe80::2", 1)]
    hosts = hostlib.parse_hosts("[::1]:2,b:1")
    assert hostlib.hostfile_text(hosts) == "::1 slots=2\nb slots=1\n"  # Open MPI's hostfile takes them bare
    cmd = build(["-np", "3", "-H", "[::1]:2,b:1", "python", "train.py"], hostfile="/tmp/h")
    assert pairs(cmd, "--hostfile") == ["/tmp/h"] and "-H" not in cmd
    with pytest.raises(LaunchError, match="hostfile"):
        build(["-np", "3", "-H", "[::1]:2,b:1", "python", "train.py"])
    with pytest.raises(LaunchError, match="IPv6"):
        build(["-np", "3", "-H", "[::1]:2,b:1", "python", "train.py"], impl=MpiImpl.MPICH)
    with pytest.raises(LaunchError, match="Open MPI 4.1.4 cannot address hosts by IPv6"):  # ORTE: names only
        build(["-np", "3", "-H", "[::1]:2,b:1", "python", "train.py"], version=(4, 1, 4), hostfile="/tmp/h")


def test_open_mpi_4_and_5_get_the_same_line():
    argv = ["-np", "2", "-H", "a:1,b:1", "--network-interface", "eth0", "python", "train.py"]
    assert build(argv, version=(4, 1, 4)) == build(argv, version=(5, 0, 11))


def test_hostfile(tmp_path):
    f = tmp_path / "hosts"
    f.write_text("# cluster\nnode1 slots=4\n\nnode2 slots=2  # GPU box\nnode1 slots=1\nnode3\n")
    assert hostlib.parse_hostfile(str(f)) == [hostlib.Host("node1", 5), hostlib.Host("node2", 2),
                                               hostlib.Host("node3", 1)]
    cmd = build(["--hostfile", str(f), "python", "train.py"])
    assert pairs(cmd, "-np") == ["8"] and pairs(cmd, "-H") == ["node1:5,node2:2,node3:1"]


@pytest.mark.parametrize("text", ["node1 slots=two\n", "node1 cpus=2\n", "node1 slots=0\n", "# nothing\n"])
def test_bad_hostfile(tmp_path, text):
    f = tmp_path / "hosts"
    f.write_text(text)
    with pytest.raises(LaunchError):
        hostlib.parse_hostfile(str(f))


def test_hosts_spec_parsing():
    assert hostlib.parse_hosts("a:2,b,a:1") == [hostlib.Host("a", 3), hostlib.Host("b", 1)]
    assert hostlib.parse_hosts("198.18.0.1:2") == [hostlib.Host("198.18.0.1", 2)]
    with pytest.raises(LaunchError, match="whole number"):
        hostlib.parse_hosts("a:x")
    assert hostlib.ranks_per_host([hostlib.Host("a", 2), hostlib.Host("b", 2)], 3) == [2, 1]


def test_more_ranks_than_slots():
    with pytest.raises(LaunchError, match="more than the 3 slots"):
        build(["-np", "4", "-H", "a:2,b:1", "python", "train.py"])


def test_unknown_host():
    def resolve(name, _port):
        import socket
        raise socket.gaierror("nope")

    with pytest.raises(LaunchError, match="unknown host 'ghost'"):
        hostlib.check_resolvable([hostlib.Host("ghost", 1)], resolve)


def test_missing_and_unknown_mpi():
    with pytest.raises(LaunchError, match="cannot run here"):
        build(["-np", "2", "python", "train.py"], impl=MpiImpl.MISSING)
    with pytest.raises(LaunchError, match="names no MPI"):
        build(["-np", "2", "python", "train.py"], impl=MpiImpl.UNKNOWN)


def test_np_required_without_hosts():
    with pytest.raises(LaunchError, match="-np is required"):
        build(["python", "train.py"])


@pytest.mark.parametrize("output,impl,version", [
    ("mpirun (Open MPI) 4.1.4\n\nReport bugs to http://www.open-mpi.org/community/help/", MpiImpl.OPEN_MPI,
     (4, 1, 4)),
    ("mpirun (Open MPI) 5.0.11\n\nReport bugs to https://www.open-mpi.org/community/help/", MpiImpl.OPEN_MPI,
     (5, 0, 11)),
    ("HYDRA build details:\n    Version:                                 4.1.2\n    Release Date: ", MpiImpl.MPICH,
     (4, 1, 2)),
    ("Intel(R) MPI Library for Linux* OS, Version 2021.10 Build 20230619", MpiImpl.INTEL_MPI, (2021, 10)),
    ("something else", MpiImpl.UNKNOWN, ()),
])
def test_classify_mpi(output, impl, version):
    assert classify_mpi_version(output) is impl
    assert parse_mpi_version(output) == (impl, version)


def test_mpich_and_intel_flags():
    cmd = build(["-np", "4", "-H", "a:2,b:2", "python", "train.py"], {"NCCL_DEBUG": "INFO"}, impl=MpiImpl.MPICH)
    assert pairs(cmd, "-hosts") == ["a:2,b:2"] and "-l" in cmd and "-x" not in cmd
    i = cmd.index("-bind-to")  # Hydra's single-dash forms
    assert cmd[i:i + 4] == ["-bind-to", "none", "-map-by", "slot"]
    assert pairs(cmd, "-genvlist") == ["NCCL_DEBUG,OMP_NUM_THREADS"]


def test_intel_mpi_flags():
    """Intel MPI's mpiexec.hydra: -n, -hosts names -ppn slots, -genvlist, -l, -iface; no Open MPI flags, even as root."""
    cmd = build(["-np", "4", "-H", "a:2,b:2", "--network-interface", "ib0", "python", "train.py"],
                {"NCCL_DEBUG": "INFO", "HOME": "/root"}, impl=MpiImpl.INTEL_MPI, version=(2021, 10), euid=0,
                cpu_count=1)
    assert cmd[:3] == ["mpirun", "-n", "4"] and "-np" not in cmd
    assert pairs(cmd, "-hosts") == ["a,b"] and pairs(cmd, "-ppn") == ["2"] and "-l" in cmd
    assert pairs(cmd, "-iface") == ["ib0"]
    assert pairs(cmd, "-genvlist") == ["FI_SOCKETS_IFACE,FI_TCP_IFACE,HVPS_NETWORK_INTERFACE,NCCL_DEBUG,"
                                       "NCCL_SOCKET_IFNAME,OMP_NUM_THREADS"]
    for flag in ("-bind-to", "--bind-to", "-x", "--allow-run-as-root", "--oversubscribe", "--mca", "-genv"):
        assert flag not in cmd, flag
    assert cmd[-2:] == ["python", "train.py"]
    local = build(["-np", "2", "python", "train.py"], impl=MpiImpl.INTEL_MPI)
    assert "-hosts" not in local and "-iface" not in local and local[:3] == ["mpirun", "-n", "2"]
    with pytest.raises(LaunchError, match="Intel MPI needs the same slots"):
        build(["-np", "3", "-H", "a:2,b:1", "python", "train.py"], impl=MpiImpl.INTEL_MPI)
    with pytest.raises(LaunchError, match="Intel MPI takes no IPv6"):
        build(["-np", "2", "-H", "[fd00::1]:2", "python", "train.py"], impl=MpiImpl.INTEL_MPI)


def test_intel_mpi_is_one_table_entry():
    """The command builder reads the table: an entry's fields are the flags it gets."""
    spec = MpiImpl.INTEL_MPI.spec
    assert (spec.executable, spec.np_flag, spec.env_list, spec.ppn_flag) == ("mpiexec.hydra", "-n", "-genvlist", "-ppn")
    assert (spec.ranks.rank, spec.ranks.size, spec.ranks.local_rank, spec.ranks.local_size) == (
        "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS")
    assert [impl for impl in MpiImpl if impl.spec.known] == [MpiImpl.OPEN_MPI, MpiImpl.INTEL_MPI, MpiImpl.MPICH]


def test_cores_per_rank():
    assert cores_per_rank(4, [], 8) == 2
    assert cores_per_rank(16, [], 8) == 1
    assert cores_per_rank(3, [hostlib.Host("a", 1), hostlib.Host("b", 2)], 16) == 8


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("-np", "--hosts", "--hostfile", "--mpi-args", "--network-interface", "--timeline-filename",
                 "--fusion-threshold-mb", "--cycle-time-ms", "--stall-check-time-seconds", "--check-build",
                 "--verbose", "--dry-run", "--max-restarts", "--checkpoint-dir"):
        assert flag in text
    for action in build_parser()._actions:
        assert action.help, f"{action.option_strings} has no help"


def test_checkpoint_dir_reaches_ranks():
    argv = ["-np", "2", "--checkpoint-dir", "/nfs/ckpt", "python", "train.py"]
    assert "HVPS_CHECKPOINT_DIR" in pairs(build(argv), "-x")
    assert rank_env(argv)["HVPS_CHECKPOINT_DIR"] == "/nfs/ckpt"


# ---------------------------------------------------------------------------- Slurm
SLURM_ENV = {"SLURM_JOB_ID": "42", "SLURM_NTASKS": "4", "SLURM_TASKS_PER_NODE": "2(x2)", "SLURM_CPUS_PER_TASK": "3"}


def test_srun_inside_allocation():
    assert in_slurm_allocation(SLURM_ENV) and not in_slurm_allocation({})
    settings = parse_args(["--stall-check-time-seconds", "7", "python", "train.py"])
    cmd = build_srun_command(settings, SLURM_ENV)
    assert cmd[:3] == ["srun", "--mpi=pmix", "-n"] and cmd[3] == "4"
    assert "--kill-on-bad-exit=1" in cmd and "--cpu-bind=none" in cmd
    assert cmd[-2:] == list(CMD)
    env = srun_environment(settings, SLURM_ENV, 4, cpu_count=8)
    assert env["HVPS_STALL_CHECK_TIME_SECONDS"] == "7" and env["OMP_NUM_THREADS"] == "3"


def test_srun_more_ranks_than_allocated():
    with pytest.raises(LaunchError, match="more than the 4 tasks"):
        build_srun_command(parse_args(["-np", "8", "python", "train.py"]), SLURM_ENV)


def test_srun_with_hosts():
    cmd = build_srun_command(parse_args(["-np", "4", "-H", "n1:2,n2:2", "python", "train.py"]), SLURM_ENV)
    assert cmd[cmd.index("--nodelist") + 1] == "n1,n2" and cmd[cmd.index("--ntasks-per-node") + 1] == "2"


def test_settings_dataclass_is_frozen():
    s = LaunchSettings(command=CMD, num_proc=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.num_proc = 3
    assert s.num_proc == 2


# -- issue 38: hosts that would be options, and hostfiles that are not files ---------------------------------

@pytest.mark.parametrize("spec, why", [
    ("-oProxyCommand=touch%20/tmp/x:1", "starts with '-'"),
    ("a:1,-F/etc/passwd", "starts with '-'"),
    ("host:99999999999999999999", "more than one host can have"),
    ("host:70000", "more than one host can have"),
    ("ho st:1", "is not a host name"),
])
def test_hosts_that_are_options_or_absurd_slots_are_refused(spec, why):
    with pytest.raises(LaunchError, match=why):
        hostlib.parse_hosts(spec)


def test_a_hostfile_that_is_a_fifo_dev_zero_or_huge_is_refused_at_once(tmp_path):
    import os
    import time

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    big = tmp_path / "big"
    big.write_text("node1 slots=1\n" * 100_000)
    dashed = tmp_path / "dashed"
    dashed.write_text("-oProxyCommand=x slots=1\n")
    began = time.monotonic()
    for path, why in ((fifo, "is not a regular file"), ("/dev/zero", "is not a regular file"),
                      (big, "more than a hostfile's"), (dashed, "starts with '-'")):
        with pytest.raises(LaunchError, match=why):
            hostlib.parse_hostfile(str(path))
    assert time.monotonic() - began < 5


def test_ssh_gets_the_host_after_double_dash():
    from hvps.runner import gloo_run

    plan = gloo_run.Plan(("python", "train.py"), (("node2", 1),), 1, {})
    cmd = gloo_run.ssh_command(plan, "node2")
    assert cmd[-3:-1] == ["--", "node2"]
    with pytest.raises(LaunchError, match="starts with '-'"):
        gloo_run.ssh_command(plan, "-oProxyCommand=x")


def test_every_hvpsrun_flag_the_docs_mention_is_accepted():
    """Issue 38: the README told users to run ``hvpsrun --enable-recovery`` (Open MPI's flag), which hvpsrun
    rejects; restarts are ``--max-restarts N``. Every ``hvpsrun ...`` example's flags (in the README,
    SECURITY.md and the docs site, inline or as a code block's line) must be hvpsrun's."""
    import re
    from pathlib import Path

    known = {flag for action in build_parser()._actions for flag in action.option_strings}
    root = Path(__file__).resolve().parent.parent
    unknown = set()
    docs = ["README.md", "SECURITY.md", *sorted(str(p.relative_to(root)) for p in (root / "docs").rglob("*.md"))]
    for doc in docs:
        for example in re.findall(r"`hvpsrun ([^`]*)`|^(?:\$ )?hvpsrun (.*)$", (root / doc).read_text(), re.M):
            # hvpsrun's own flags come before the program; what follows it is the program's
            example = re.split(r"\s(?:python3?|\S+\.py|\S+\.sh)(?:\s|$)", " " + "".join(example))[0]
            unknown |= {(doc, flag) for flag in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", example)} - \
                {(doc, flag) for flag in known}
    assert not unknown, unknown
