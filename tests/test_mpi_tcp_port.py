"""Open MPI's TCP BTL port: hvpsrun keeps it closed on one host and binds it to the training
interface across hosts; a 3-byte connection to a rank's port must not freeze a 2-rank job;
hvps doctor warns when the TCP BTL would listen on every interface."""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

import pytest
from conftest import REPO_ROOT, _base_env, mpi_launcher, mpirun_argv

from hvps.doctor import REGISTRY, Context, Host
from hvps.doctor.host import FACTS_FILE
from hvps.runner.launch import prepare
from hvps.runner.mpi_command import build_mpirun_command, rank_environment
from hvps.runner.mpi_discovery import MpiImpl, MpiLauncher
from hvps.runner.mpi_transport import exposure_warning, open_mpi_transport_args, tcp_btl_on
from hvps.runner.settings import parse_args
from hvps.runner.slurm_command import srun_environment

LOCAL = {"localhost", "127.0.0.1", "thisbox"}
HOLD_SECONDS = 4.0

#: one rank: hvps allreduces in a loop, a timestamp after each; rank 0 ends the loop (for both
#: ranks, through an allreduce) two seconds after the test writes OUT/released
RANK_PROGRAM = """
import json, os, sys, time
import numpy as np
import hvps
out = sys.argv[1]
hvps.init()
rank = hvps.rank()
x = np.random.default_rng(rank).random(1024).astype(np.float32)
expected = hvps.allreduce(x, name="warmup", op=hvps.Sum)
open(os.path.join(out, f"pid{rank}"), "w").write(str(os.getpid()))
stamps, i, released, start = [], 0, None, time.monotonic()
while True:
    got = hvps.allreduce(x, name=f"a{i % 4}", op=hvps.Sum)
    stamps.append(time.time())
    i += 1
    if i % 20 == 0:
        if released is None and os.path.exists(os.path.join(out, "released")):
            released = time.monotonic()
        stop = rank == 0 and ((released is not None and time.monotonic() - released > 2)
                              or time.monotonic() - start > 120)
        if hvps.allreduce(np.array([float(stop)]), name="stop", op=hvps.Sum)[0] > 0:
            break
assert np.allclose(got, expected)
json.dump(stamps, open(os.path.join(out, f"stamps{rank}.json"), "w"))
hvps.shutdown()
"""


def build(argv, env=None, version=(5, 0, 11), impl=MpiImpl.OPEN_MPI, **kw):
    kw.setdefault("cpu_count", 8)
    kw.setdefault("euid", 1000)
    kw.setdefault("local_names", LOCAL)
    return build_mpirun_command(parse_args(argv), env or {}, mpi=MpiLauncher("mpirun", "PATH", impl, version), **kw)


def mca(cmd) -> dict:
    """``--mca NAME VALUE`` pairs of a command line (a repeated NAME keeps every value)."""
    found: dict = {}
    for i, flag in enumerate(cmd[:-2]):
        if flag == "--mca":
            found.setdefault(cmd[i + 1], []).append(cmd[i + 2])
    return found


@pytest.mark.unit
@pytest.mark.parametrize("version,btl", [((5, 0, 11), "self,sm"), ((4, 1, 4), "self,vader")])
def test_one_host_runs_without_the_tcp_btl(version, btl):
    for argv in (["-np", "2", "python", "t.py"], ["-np", "2", "-H", "localhost:2", "python", "t.py"]):
        assert mca(build(argv, version=version)) == {"btl": [btl]}
    assert not tcp_btl_on(btl) and tcp_btl_on(None) and tcp_btl_on("tcp,self") and not tcp_btl_on("^tcp,openib")


@pytest.mark.unit
def test_across_hosts_the_tcp_btl_is_bound_to_the_training_interface():
    cmd = build(["-np", "4", "-H", "a:2,b:2", "--network-interface", "ib0", "python", "t.py"])
    assert mca(cmd) == {"btl_tcp_if_include": ["ib0"], "oob_tcp_if_include": ["ib0"]}
    assert exposure_warning(False, ("ib0",), [], {}) is None
    assert "--network-interface" in exposure_warning(False, (), [], {})
    assert mca(build(["-np", "4", "-H", "a:2,b:2", "python", "t.py"])) == {}


@pytest.mark.unit
def test_a_loopback_interface_is_kept_out_of_the_runtimes_wiring():
    """PRRTE refuses ``oob_tcp_if_include lo`` on a host with any other interface; the BTL still takes it."""
    from hvps.runner.mpi_transport import is_loopback

    assert is_loopback("lo") and not is_loopback("ib0")
    assert open_mpi_transport_args((5, 0), False, ("lo",), [], {}) == ["--mca", "btl_tcp_if_include", "lo"]
    assert open_mpi_transport_args((5, 0), False, ("lo", "ib0"), [], {}) == [
        "--mca", "btl_tcp_if_include", "lo,ib0", "--mca", "oob_tcp_if_include", "ib0"]


@pytest.mark.unit
def test_the_users_own_choice_is_never_given_twice():
    """prterun refuses a parameter set twice; a flag would override the user's OMPI_MCA_* variable."""
    cmd = build(["-np", "2", "--mpi-args=--mca btl tcp,self", "python", "t.py"])
    assert mca(cmd) == {"btl": ["tcp,self"]}
    assert mca(build(["-np", "2", "python", "t.py"], {"OMPI_MCA_btl": "tcp,self"})) == {}
    # a default hostfile in the environment (the netns testbed's) or hosts in --mpi-args: not "one host"
    assert mca(build(["-np", "2", "python", "t.py"], {"PRTE_MCA_prte_default_hostfile": "/h"})) == {}
    assert mca(build(["-np", "2", "--mpi-args=--hostfile /h", "python", "t.py"])) == {}
    cmd = build(["-np", "4", "-H", "a:2,b:2", "--network-interface", "eth1",
                 "--mpi-args=--mca btl_tcp_if_include 10.0.0.0/24", "python", "t.py"])
    assert mca(cmd) == {"btl_tcp_if_include": ["10.0.0.0/24"], "oob_tcp_if_include": ["eth1"]}
    assert exposure_warning(False, (), ["--mca", "btl", "self,sm"], {}) is None
    assert exposure_warning(False, (), [], {"OMPI_MCA_btl_tcp_if_include": "eth0"}) is None


@pytest.mark.unit
def test_slurm_and_mpich():
    one_node = {"SLURM_JOB_ID": "1", "SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2"}
    cmd = build(["-np", "2", "python", "t.py"], one_node, in_allocation=True)
    assert mca(cmd) == {"btl": ["self,sm"]}
    two_nodes = dict(one_node, SLURM_JOB_NUM_NODES="2")
    assert mca(build(["-np", "2", "python", "t.py"], two_nodes, in_allocation=True)) == {}
    settings = parse_args(["-np", "2", "python", "t.py"])
    assert srun_environment(settings, one_node, 2, 8)["OMPI_MCA_btl"] == "self,vader"  # 5.x: an alias of sm
    assert "OMPI_MCA_btl" not in srun_environment(settings, two_nodes, 2, 8)
    assert srun_environment(settings, dict(one_node, OMPI_MCA_btl="tcp,self"), 2, 8)["OMPI_MCA_btl"] == "tcp,self"
    assert open_mpi_transport_args((5, 0), True, (), [], {}) == ["--mca", "btl", "self,sm"]
    assert "--mca" not in build(["-np", "2", "python", "t.py"], impl=MpiImpl.MPICH, version=(4, 2))
    # MPICH's ch4:ofi listener follows libfabric's interface variables, not Hydra's -iface
    argv = ["-np", "2", "--network-interface", "ib0,eth0", "python", "t.py"]
    cmd = build(argv, impl=MpiImpl.MPICH, version=(5, 0, 2))
    genv = cmd[cmd.index("-genvlist") + 1].split(",")
    assert {"FI_TCP_IFACE", "FI_SOCKETS_IFACE"} <= set(genv) and cmd[cmd.index("-iface") + 1] == "ib0"
    settings = parse_args(argv)
    assert rank_environment(settings, {}, 2, [], 8)["FI_TCP_IFACE"] == "ib0"
    assert "FI_TCP_IFACE" not in rank_environment(settings, {"FI_TCP_IFACE": "eth9"}, 2, [], 8)


def test_hvpsrun_warns_when_open_mpi_would_listen_everywhere(capsys):
    if mpi_launcher().impl is not MpiImpl.OPEN_MPI:
        pytest.skip("needs Open MPI")
    env = dict(os.environ, HVPS_MPIRUN=mpi_launcher().path)
    launch = prepare(parse_args(["-np", "2", sys.executable, "-c", "0"]), env)
    assert "warning" not in capsys.readouterr().err and mca(launch.argv)["btl"][0].startswith("self,")
    prepare(parse_args(["-np", "2", "-H", "localhost:1,10.255.255.1:1", sys.executable, "-c", "0"]), env)
    err = capsys.readouterr().err
    assert "hvpsrun: warning: Open MPI's TCP transport will listen on and use every interface" in err
    prepare(parse_args(["-np", "2", "-H", "localhost:1,10.255.255.1:1", "--network-interface", "lo",
                        sys.executable, "-c", "0"]), env)
    assert "warning" not in capsys.readouterr().err


def _listeners(pid: int) -> list:
    """``(address, port)`` of the TCP sockets ``pid`` listens on (``ss -tlnp``)."""
    out = subprocess.run(["ss", "-tlnpH"], capture_output=True, text=True, check=True).stdout
    found = []
    for line in out.splitlines():
        if f"pid={pid}," in line:
            host, _, port = line.split()[3].rpartition(":")
            found.append((host.strip("[]"), int(port)))
    return found


def _connect(host: str, port: int, via: Optional[dict] = None) -> socket.socket:
    """A connection to a listener, sending 3 bytes; ``via``: the address to use per family (4, 6)."""
    v6 = ":" in host
    target = ("::1" if v6 else "127.0.0.1") if host in ("*", "0.0.0.0", "::") else host
    target = (via or {}).get(6 if v6 else 4, target)
    s = socket.socket(socket.AF_INET6 if v6 else socket.AF_INET)
    s.settimeout(5)
    s.connect((target, port))
    s.sendall(b"abc")
    return s


def hold_attack(out: Path, proc: subprocess.Popen, hold: float, via: Optional[dict] = None) -> dict:
    """Once both ranks run, hold a 3-byte connection to every TCP port they listen on for ``hold``
    seconds; the longest gap between allreduces during the hold and before it."""
    deadline = time.monotonic() + 120
    while not all((out / f"pid{r}").exists() for r in (0, 1)):
        assert proc.poll() is None and time.monotonic() < deadline, "the job did not start"
        time.sleep(0.1)
    time.sleep(2)
    pids = [int((out / f"pid{r}").read_text()) for r in (0, 1)]
    ports = [(pid, h, p) for pid in pids for h, p in _listeners(pid)]
    start = time.time()
    socks = [_connect(h, p, via) for _, h, p in ports]
    time.sleep(hold)
    for s in socks:
        s.close()
    end = time.time()
    (out / "released").write_text("")
    proc.wait(timeout=180)
    stamps = json.loads((out / "stamps0.json").read_text())
    gaps = [(a, b) for a, b in itertools.pairwise(stamps)]
    return {"listeners": ports, "before": max(b - a for a, b in gaps if b < start),
            "during": max((b - a for a, b in gaps if b >= start and a <= end), default=0.0),
            "iterations": len(stamps), "returncode": proc.returncode}


def attack_job(tmp_path: Path, hold: float, env: Optional[dict] = None, via: Optional[dict] = None) -> dict:
    """A 2-rank job on hvps's own mpirun line, attacked by :func:`hold_attack`."""
    program = tmp_path / "rank.py"
    program.write_text(RANK_PROGRAM)
    out = tmp_path / "out"
    out.mkdir()
    cmd, full = mpirun_argv(2, [sys.executable, str(program), str(out)], _base_env(env))
    with open(tmp_path / "job.log", "wb") as log:
        proc = subprocess.Popen(cmd, cwd=str(REPO_ROOT), env=full, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            result = hold_attack(out, proc, hold, via)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
    return dict(result, command=" ".join(cmd), log=(tmp_path / "job.log").read_text(errors="replace")[-3000:])


@pytest.mark.timeout(300)
def test_a_stray_connection_does_not_freeze_a_one_host_job(tmp_path):
    """The audit's attack: 3 bytes to a rank's MPI port froze every collective while held."""
    result = attack_job(tmp_path, HOLD_SECONDS)
    assert result["returncode"] == 0, result["log"]
    assert result["during"] < HOLD_SECONDS / 2, result


def _doctor_host(tmp_path: Path, env: dict, mpi: str = "Open MPI 5.0.11", files: dict = None) -> Host:
    tmp_path.mkdir(parents=True, exist_ok=True)
    for rel, text in (files or {}).items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    (tmp_path / FACTS_FILE).write_text(json.dumps({"env": env, "software": {"mpi": mpi}}))
    return Host(str(tmp_path))


@pytest.mark.unit
@pytest.mark.parametrize("env,ctx,verdict", [
    ({}, {}, "ok"),                                                   # not in a job: nothing listens yet
    ({"OMPI_MCA_btl": "self,sm"}, {"world_size": 2}, "ok"),           # what hvpsrun passes on one host
    ({"OMPI_MCA_btl": "^tcp"}, {"world_size": 2}, "ok"),
    ({"OMPI_MCA_btl_tcp_if_include": "ib0"}, {"world_size": 4, "multi_host": True}, "ok"),
    ({"OMPI_COMM_WORLD_SIZE": "2"}, {}, "warn"),                      # plain mpirun: TCP BTL on every interface
    ({}, {"world_size": 2}, "warn"),
    ({"OMPI_MCA_btl": "tcp,self"}, {}, "warn"),
])
def test_doctor_warns_when_the_tcp_btl_listens_everywhere(tmp_path, env, ctx, verdict):
    row = REGISTRY["net.mpi_tcp"].func(_doctor_host(tmp_path, env), Context(**ctx))
    assert row.verdict == verdict, row
    assert row.why and (row.fix or verdict == "ok")
    if verdict == "warn":
        assert "every interface" in row.value and "--network-interface" in row.fix and "self,sm" in row.fix


@pytest.mark.unit
def test_doctor_reads_the_users_mca_params_file_and_skips_mpich(tmp_path):
    host = _doctor_host(tmp_path / "a", {"HOME": "/home/u", "OMPI_COMM_WORLD_SIZE": "2"},
                        files={"home/u/.openmpi/mca-params.conf": "# site\nbtl = self,vader\n"})
    assert REGISTRY["net.mpi_tcp"].func(host, Context()).verdict == "ok"
    row = REGISTRY["net.mpi_tcp"].func(_doctor_host(tmp_path / "b", {}, mpi="MPICH 4.2.0"), Context(world_size=2))
    assert row.verdict == "skip" and "FI_TCP_IFACE" in row.why


@pytest.mark.timeout(300)
def test_doctor_under_mpirun_sees_what_the_ranks_were_given(tmp_path):
    """hvps's mpirun line (btl self,sm on one host) is ok; the same line without it warns."""
    if mpi_launcher().impl is not MpiImpl.OPEN_MPI:
        pytest.skip("needs Open MPI")
    verdicts = {}
    for name in ("hvpsrun", "plain"):
        report = tmp_path / f"{name}.json"
        cmd, env = mpirun_argv(2, [sys.executable, "-m", "hvps.doctor", "--all-ranks", "--only", "net.mpi_tcp",
                                   "--json", "--output", str(report)], _base_env(None))
        if name == "plain":
            i = cmd.index("btl")
            del cmd[i - 1:i + 2]
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        verdicts[name] = json.loads(report.read_text())["checks"][0]["verdict"]
    assert verdicts == {"hvpsrun": "ok", "plain": "warn"}


if __name__ == "__main__":
    # benchmarks/RESULTS.md's measurement:
    #   python tests/test_mpi_tcp_port.py HOLD_SECONDS [VAR=VALUE ...] [via4=ADDR] [via6=ADDR]
    import tempfile

    args = dict(a.split("=", 1) for a in sys.argv[2:])
    via = {int(k[3:]): args.pop(k) for k in list(args) if k.startswith("via")}
    with tempfile.TemporaryDirectory() as tmp:
        r = attack_job(Path(tmp), float(sys.argv[1]), args, via)
    print(f"{r['command']}\nlisteners attacked: {r['listeners']}\nrc {r['returncode']}, {r['iterations']} allreduces; "
          f"longest gap before the attack {r['before']:.3f} s, during the {sys.argv[1]} s hold {r['during']:.3f} s")
