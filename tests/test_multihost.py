"""hvps across emulated hosts: network namespaces with their own hostnames, joined by
a bridge with a 1 Gbit/s rate limit (tests/netns_cluster.py, jobs/testbed/netns-cluster.sh).

mpirun reaches the hosts through the testbed's rsh agent (``ip netns exec`` +
``unshare --uts``); ranks talk over TCP only (``--mca btl tcp,self``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT, _base_env, run_mpi
from netns_cluster import NetnsCluster, unavailable_reason

INNER = Path(__file__).resolve().parent / "multihost"
HVPSRUN = [sys.executable, "-m", "hvps.runner.launch"]
STALL_SECONDS = 5.0
HOSTS = 3

_REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=f"no emulated hosts here: {_REASON}")


@pytest.fixture(scope="module")
def cluster():
    c = NetnsCluster(HOSTS, rate="1gbit")
    c.up()
    try:
        yield c
    finally:
        c.down()
    assert not Path(f"/var/run/netns/{c.namespace(0)}").exists(), "the fixture left a namespace behind"


class Job:
    """A launcher started in its own session with output to a file, read while it runs."""

    def __init__(self, argv: list, env: dict, log: Path) -> None:
        self.log = log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(argv, cwd=str(REPO_ROOT), env=env, stdout=self._out, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, predicate, timeout: float, poll: float = 0.1) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate(self.text()):
                return True
            if self.proc.poll() is not None:
                return predicate(self.text())
            time.sleep(poll)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        self._out.close()


def _env(extra: dict) -> dict:
    env = _base_env(extra)
    env.pop("OMPI_MCA_rmaps_base_oversubscribe", None)
    return env


def _topology(text: str) -> dict:
    rows = {}
    for m in re.finditer(r"TOPOLOGY (\{.*?\})(?=\[\d+,\d+\]<std|\n|$)", text):
        row = json.loads(m.group(1))
        rows[row["rank"]] = row
    return rows


def test_testbed_hosts_have_own_names_and_rate_limit(cluster):
    for i in range(HOSTS):
        out = subprocess.run([str(cluster.agent), cluster.address(i), "hostname"], capture_output=True, text=True,
                             timeout=30)
        assert out.returncode == 0, out.stderr
        assert out.stdout.strip() == cluster.hostname(i)
        qdisc = cluster.run_in(i, ["tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True).stdout
        assert "tbf" in qdisc and "rate 1Gbit" in qdisc, qdisc
    # TCP from host 0 to the last host, over the bridge
    server = cluster.popen_in(HOSTS - 1, [sys.executable, "-c", (
        "import socket; s = socket.create_server(('0.0.0.0', 47001)); s.settimeout(20); "
        "c, a = s.accept(); c.sendall(a[0].encode()); c.close()")], stdout=subprocess.PIPE)
    client = (f"import socket, time\nfor _ in range(100):\n    try:\n"
              f"        c = socket.create_connection(('{cluster.address(HOSTS - 1)}', 47001), timeout=5); break\n"
              f"    except ConnectionRefusedError:\n        time.sleep(0.1)\nprint(c.recv(100).decode())")
    seen = cluster.run_in(0, [sys.executable, "-c", client], capture_output=True, text=True, timeout=30)
    server.wait(timeout=30)
    assert seen.stdout.strip() == cluster.address(0), seen.stderr


@pytest.mark.timeout(600)
def test_collectives_across_hosts(cluster):
    """The core's collective suite (allreduce, allgather, broadcast, alltoall, reducescatter,
    barrier, objects) with one rank on each of 3 hosts. Its single-host topology test is
    replaced by test_hvpsrun_hostfile_launch."""
    result = run_mpi("mpi_collectives.py", HOSTS, env=cluster.ompi_env(), timeout=420,
                     extra_pytest_args=["-k", "not test_topology"])
    result.assert_all_passed(min_passed=20)


@pytest.mark.timeout(300)
def test_hvpsrun_hostfile_launch(cluster, tmp_path):
    """hvpsrun --hostfile with 2 slots on host 0 and 1 on host 1: ranks land where the
    hostfile says, each host reports its own hostname, local/cross topology follows."""
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"# two emulated hosts\n{cluster.address(0)} slots=2\n{cluster.address(1)} slots=1\n")
    argv = HVPSRUN + ["-np", "3", "--hostfile", str(hostfile), "--mpi-args", cluster.mpi_args,
                      "--stall-check-time-seconds", "30", sys.executable, str(INNER / "mh_topology.py")]
    proc = subprocess.run(argv, cwd=str(REPO_ROOT), env=_env({}), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = _topology(proc.stdout)
    assert sorted(rows) == [0, 1, 2], proc.stdout
    names = [cluster.hostname(0), cluster.hostname(0), cluster.hostname(1)]
    for rank, row in rows.items():
        assert row["size"] == 3
        assert row["hostname"] == names[rank]
        assert row["hostnames"] == names
        assert row["sum"] == 6
        assert row["broadcast"] == 27
    assert (rows[0]["local_rank"], rows[0]["local_size"]) == (0, 2)
    assert (rows[1]["local_rank"], rows[1]["local_size"]) == (1, 2)
    assert (rows[2]["local_rank"], rows[2]["local_size"]) == (0, 1)
    # cross = ranks that share a local rank: {0, 2} (local rank 0 on each host) and {1}
    assert [(rows[r]["cross_rank"], rows[r]["cross_size"]) for r in range(3)] == [(0, 2), (0, 1), (1, 2)]


def _start_linkcut(cluster, tmp_path, elements: int, gap: float) -> Job:
    argv = HVPSRUN + ["-np", str(HOSTS), "--hostfile", str(cluster.hostfile), "--mpi-args", cluster.mpi_args,
                      "--stall-check-time-seconds", f"{STALL_SECONDS:g}", sys.executable,
                      str(INNER / "mh_linkcut.py")]
    # hvps's ring watches every peer and names the one that stopped moving data;
    # across hosts the default is MPI's Allreduce, which can only be timed out whole.
    env = _env({"MH_ELEMENTS": str(elements), "MH_GAP": str(gap), "HVPS_ALLREDUCE_ALGORITHM": "ring"})
    return Job(argv, env, tmp_path / "linkcut.log")


def _errors(text: str) -> dict:
    # --tag-output may glue two ranks' lines together: a message ends at the next tag or newline
    found = {}
    for m in re.finditer(r"HVPS_ERROR (\d+) ([\d.]+) (.*?)(?=\[\d+,\d+\]<std|\n|$)", text):
        found[int(m.group(1))] = (float(m.group(2)), m.group(3))
    return found


def _steps(text: str, kind: str = "STEP") -> dict:
    done: dict = {}
    for m in re.finditer(rf"{kind} (\d+) (\d+) ([\d.]+)", text):
        done.setdefault(int(m.group(1)), []).append((int(m.group(2)), float(m.group(3))))
    return done


def _cut_and_expect_errors(cluster, job: Job, victim: int, margin: float) -> None:
    survivors = [r for r in range(HOSTS) if r != victim]
    t_cut = time.time()
    cluster.cut(victim)
    try:
        job.wait_for(lambda t: set(_errors(t)) >= set(survivors), timeout=STALL_SECONDS + margin)
        text = job.text()
        errors = _errors(text)
        missing = [r for r in survivors if r not in errors]
        assert not missing, (f"surviving ranks {missing} raised no hvps error within "
                             f"{STALL_SECONDS + margin:g} s of the link cut (a hang):\n{text[-6000:]}")
        for rank in survivors:
            t_err, message = errors[rank]
            assert t_err - t_cut <= STALL_SECONDS + margin, f"rank {rank} took {t_err - t_cut:.1f} s: {message}"
            assert "stall" in message or "failed" in message, message
            assert str(victim) in message, f"rank {rank}'s error does not name the lost rank {victim}: {message}"
    finally:
        cluster.restore(victim)
        job.stop()
        cluster.kill_processes()


@pytest.mark.timeout(180)
def test_link_cut_between_steps_fails_every_survivor(cluster, tmp_path):
    """One rank per host, small allreduces with pauses; host 2's link goes down between steps.
    Ranks 0 and 1 must each raise a clear hvps stall error naming rank 2 within the stall
    time (plus one pause and start-up slack), not hang."""
    job = _start_linkcut(cluster, tmp_path, elements=1024, gap=0.5)
    ok = job.wait_for(lambda t: all(len(_steps(t).get(r, [])) >= 3 for r in range(HOSTS)), timeout=90)
    assert ok, "the job did not start:\n" + job.text()[-4000:]
    # cut right after a step completed everywhere, inside the pause
    last = len(_steps(job.text())[0])
    job.wait_for(lambda t: all(len(_steps(t).get(r, [])) > last for r in range(HOSTS)), timeout=10, poll=0.01)
    time.sleep(0.1)
    _cut_and_expect_errors(cluster, job, victim=HOSTS - 1, margin=4.0)


@pytest.mark.timeout(180)
def test_link_cut_during_transfer_fails_every_survivor(cluster, tmp_path):
    """16 MiB allreduces through a 100 Mbit/s link (about 2 s of data per step): the cut
    lands while data is in flight. Every survivor must still report an error, not hang."""
    cluster.set_rate("100mbit")
    try:
        job = _start_linkcut(cluster, tmp_path, elements=4 << 20, gap=0.0)
        ok = job.wait_for(lambda t: all(len(_steps(t).get(r, [])) >= 1 for r in range(HOSTS)), timeout=120)
        assert ok, "the job did not start:\n" + job.text()[-4000:]
        submitted = len(_steps(job.text(), "SUBMIT")[0])
        job.wait_for(lambda t: len(_steps(t, "SUBMIT").get(0, [])) > submitted, timeout=30, poll=0.01)
        time.sleep(0.5)  # the next allreduce is now moving data
        _cut_and_expect_errors(cluster, job, victim=HOSTS - 1, margin=8.0)
    finally:
        cluster.set_rate("1gbit")


SNIFFER = """
import socket, struct, sys, os
pattern, stop = sys.argv[1].encode(), sys.argv[2]
s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(3))
# a receive buffer far larger than the job's traffic (root: SO_RCVBUFFORCE, 33): a sniffer that a loaded machine
# schedules late must not lose frames (under load the default buffer dropped half the job's bytes)
s.setsockopt(socket.SOL_SOCKET, getattr(socket, "SO_RCVBUFFORCE", 33), 256 << 20)
s.bind(("eth0", 0))
s.settimeout(0.2)
hits = frames = nbytes = 0
print("SNIFFING", flush=True)
while not os.path.exists(stop):
    try:
        frame = s.recv(65536)
    except socket.timeout:
        continue
    frames += 1
    nbytes += len(frame)
    hits += frame.count(pattern)
# the kernel's count of frames this socket dropped (SOL_PACKET 263, PACKET_STATISTICS 6: tp_packets, tp_drops)
drops = struct.unpack("II", s.getsockopt(263, 6, 8))[1]
print(f"CAPTURE {frames} {nbytes} {hits} {drops}", flush=True)
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("encrypt", [False, True], ids=["clear", "encrypted"])
def test_sealed_data_plane_sends_no_plaintext_between_hosts(cluster, tmp_path, encrypt):
    """A raw socket on host 1's link captures every frame while a byte pattern is allreduced, broadcast
    and pulled from the sharded store between 2 hosts: with --encrypt the pattern never appears on the
    wire; without, it does (so the test can fail)."""
    pytest.importorskip("cryptography")
    pytest.importorskip("torch")
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text(f"{cluster.address(0)} slots=1\n{cluster.address(1)} slots=1\n")
    stop = tmp_path / "stop"
    sniffer = cluster.popen_in(1, [sys.executable, "-c", SNIFFER, "hvps27-CLEAR-txt", str(stop)],
                               stdout=subprocess.PIPE, text=True)
    assert sniffer.stdout.readline().strip() == "SNIFFING"
    argv = HVPSRUN + ["-np", "2", "--hostfile", str(hostfile), "--mpi-args", cluster.mpi_args,
                      *(["--encrypt"] if encrypt else []), sys.executable, str(INNER / "mh_sealed.py")]
    try:
        proc = subprocess.run(argv, cwd=str(REPO_ROOT), env=_env({}), capture_output=True, text=True, timeout=240)
    finally:
        stop.write_text("")
        out, _ = sniffer.communicate(timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("SEALED-DONE") == 2, proc.stdout
    frames, nbytes, hits, drops = (int(x) for x in out.split("CAPTURE ", 1)[1].split())
    print(f"encrypt={encrypt}: {frames} frames, {nbytes} bytes captured, pattern seen {hits} times, {drops} dropped")
    assert drops == 0, f"the capture dropped {drops} frames: it cannot vouch for what crossed the link"
    assert nbytes > 2 << 20, f"the capture saw only {nbytes} bytes: it missed the job's traffic"
    if encrypt:
        assert hits == 0, f"the pattern crossed the link in clear {hits} times under --encrypt"
    else:
        assert hits > 1000, f"the pattern was seen only {hits} times in clear: the capture is not working"
