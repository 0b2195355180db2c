"""``hvpsrun --gloo`` and its elastic mode across emulated hosts over real ssh (issue 24).

The hosts are network namespaces (tests/netns_cluster.py) with their own hostnames; each runs a real
``sshd`` on its own address (host keys, an authorized key and known_hosts made in tmp; port
:data:`SSH_PORT`, so hvpsrun's ``-p`` must be honoured). hvpsrun runs on host 0, as on the first
node of a cluster: in its namespace, with its hostname, and with a private ``/etc/hosts`` naming
every host and a private ``/etc/ssh`` whose client config points at the tmp known_hosts (bind
mounts inside the launcher's own mount namespace: nothing of this machine's /etc or ~/.ssh is
read or written). Workers on other hosts start through ``ssh`` (hvpsrun's ``-i`` gives the key),
with the secret on stdin, and join hvpsrun's rendezvous over the bridge.

Horovod's ``horovodrun`` forwards its whole environment to remote workers; hvpsrun forwards
HVPS_*, NCCL_*, PATH, PYTHON*, ... by name only, so the training script's own variables are given
on its command line (``env VAR=... python train.py``), which reaches every host.

Root, ``ip netns`` and the ssh tools are needed (else those tests skip, saying why); the last test,
``--network-interface`` on one machine, needs none of them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from netns_cluster import NetnsCluster, unavailable_reason
from test_elastic_launch import TRAIN
from test_elastic_launch import Job as ElasticJob

from hvps.control.plane import interface_address

HOSTS = 3
SSH_PORT = 2222
GLOO_JOB = str(REPO_ROOT / "tests" / "inner_jobs" / "gloo_job.py")
TAGGED = re.compile(r"^\[(\d+)\]<(stdout|stderr)>:(.*)$")
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if os.access("/usr/sbin/sshd", os.X_OK) else None)


def _reason():
    for tool, path in (("ssh", shutil.which("ssh")), ("ssh-keygen", shutil.which("ssh-keygen")), ("sshd", SSHD)):
        if path is None:
            return f"'{tool}' is missing (apt-get install openssh-client openssh-server)"
    return unavailable_reason()


_REASON = _reason()
needs_hosts = pytest.mark.skipif(_REASON is not None, reason=f"no ssh hosts here: {_REASON}")


class SshCluster:
    """A NetnsCluster whose hosts run sshd, and the way to run a command as host 0 sees the world."""

    def __init__(self, work: Path) -> None:
        pid = os.getpid()
        # a prefix and subnet of its own (198.19.x), apart from test_multihost.py's cluster
        self.net = NetnsCluster(HOSTS, prefix=f"hvs{pid % 100000}", subnet=f"198.19.{pid % 250 + 1}", rate="1gbit")
        self.work = work
        self.key = work / "id_ed25519"
        self.hosts_file = work / "etc-hosts"
        self.etc_ssh = work / "etc-ssh"
        self.sshd: list = []

    def name(self, i: int) -> str:
        return self.net.hostname(i)

    def _keygen(self, path: Path) -> str:
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "hvps-test", "-f", str(path)],
                       check=True, capture_output=True)
        return (path.parent / (path.name + ".pub")).read_text().strip()

    def up(self) -> "SshCluster":
        self.net.up()
        work = self.work
        self.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.net.address(i)} {self.name(i)}\n" for i in range(HOSTS)))
        (work / "authorized_keys").write_text(self._keygen(self.key) + "\n")
        self.etc_ssh.mkdir()
        (self.etc_ssh / "ssh_config").write_text(
            f"Host *\n    UserKnownHostsFile {work / 'known_hosts'}\n    GlobalKnownHostsFile /dev/null\n"
            "    IdentitiesOnly yes\n    ConnectTimeout 10\n    LogLevel ERROR\n")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege separation directory
        known = []
        for i in range(HOSTS):
            host_pub = self._keygen(work / f"host{i}_ed25519")
            known.append(f"[{self.name(i)}]:{SSH_PORT},[{self.net.address(i)}]:{SSH_PORT} {host_pub}\n")
            config = work / f"sshd{i}_config"
            config.write_text("\n".join([
                f"ListenAddress {self.net.address(i)}:{SSH_PORT}", f"HostKey {work / f'host{i}_ed25519'}",
                f"PidFile {work / f'sshd{i}.pid'}", f"AuthorizedKeysFile {work / 'authorized_keys'}",
                "PermitRootLogin prohibit-password", "PubkeyAuthentication yes", "PasswordAuthentication no",
                "KbdInteractiveAuthentication no", "UsePAM no", "UseDNS no", "StrictModes no", "PrintMotd no",
                "MaxStartups 50", "LogLevel INFO", ""]))
            log = open(work / f"sshd{i}.log", "wb")
            self.sshd.append((self.net.popen_in(i, self._as_host(i, [SSHD, "-D", "-e", "-f", str(config)]),
                                                stdout=log, stderr=subprocess.STDOUT), log))
        (work / "known_hosts").write_text("".join(known))
        for i in range(HOSTS):
            self._wait_listening(i)
        return self

    def _as_host(self, i: int, argv: list, ssh_config: bool = False) -> list:
        """``argv`` in a fresh UTS and mount namespace: host i's hostname, our /etc/hosts (and /etc/ssh)."""
        script = 'hostname "$1" && mount --bind "$2" /etc/hosts && '
        if ssh_config:
            script += 'mount --bind "$3" /etc/ssh && '
        script += 'shift 3 && exec "$@"'
        return ["unshare", "--uts", "--mount", "sh", "-c", script, "sh", self.name(i), str(self.hosts_file),
                str(self.etc_ssh), *argv]

    def launcher(self, argv: list) -> list:
        """``argv`` run on host 0 (hvpsrun's host)."""
        return ["ip", "netns", "exec", self.net.namespace(0), *self._as_host(0, argv, ssh_config=True)]

    def _wait_listening(self, i: int, timeout: float = 15.0) -> None:
        proc, _ = self.sshd[i]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            try:  # the bridge (this machine's side) reaches every host
                socket.create_connection((self.net.address(i), SSH_PORT), timeout=1).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError(f"sshd on {self.name(i)} did not listen (exit {proc.poll()}):\n{self.sshd_log(i)}")

    def sshd_log(self, i: int) -> str:
        return (self.work / f"sshd{i}.log").read_text(errors="replace")

    def end_jobs(self) -> None:
        """SIGKILL every process in the namespaces but the sshd listeners: what a job left behind."""
        listeners = {proc.pid for proc, _ in self.sshd}  # ip netns exec, unshare and sh exec sshd: one pid
        for _ in range(3):
            left = [pid for pid in self.net.pids() if pid not in listeners]
            if not left:
                return
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)

    def down(self) -> None:
        for proc, log in self.sshd:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
            log.close()
        self.net.down()  # ends whatever still runs in the namespaces (workers, launchers), removes them


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    cluster = SshCluster(tmp_path_factory.mktemp("ssh-hosts"))
    try:
        yield cluster.up()
    finally:
        cluster.down()
    assert not Path(f"/var/run/netns/{cluster.net.namespace(0)}").exists(), "the fixture left a namespace behind"


@pytest.fixture(autouse=True)
def _no_leftovers(request):
    """After each test, nothing of its job runs on in the namespaces (a failed test's included)."""
    yield
    if "hosts" in request.fixturenames:
        request.getfixturevalue("hosts").end_jobs()


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HVPS_", "PRTE_", "SSH_"))}
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", HVPS_STALL_CHECK_TIME_SECONDS="30")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def hvpsrun_argv(hosts: SshCluster, args: list) -> list:
    """hvpsrun on host 0, with the ssh port and key of the testbed."""
    return hosts.launcher([sys.executable, "-m", "hvps.runner.launch", "-p", str(SSH_PORT), "--ssh-identity-file",
                           str(hosts.key), *args])


def hvpsrun(hosts: SshCluster, args: list, timeout: float = 90) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(hvpsrun_argv(hosts, args), capture_output=True, text=True, env=_env(), timeout=timeout,
                              cwd=str(REPO_ROOT))
    except subprocess.TimeoutExpired as exc:
        hosts.end_jobs()
        pytest.fail(f"hvpsrun hung for {timeout} s:\n{exc.stdout}\n{exc.stderr}")


def _accepted(hosts: SshCluster, i: int) -> int:
    return hosts.sshd_log(i).count("Accepted publickey for root")


@needs_hosts
def test_ssh_reaches_every_host_by_name(hosts):
    """The testbed itself: from host 0, ssh to each host by name (key, known host key, port) lands in
    that host's namespace, under its hostname."""
    for i in range(HOSTS):
        run = subprocess.run(hosts.launcher(["ssh", "-o", "BatchMode=yes", "-p", str(SSH_PORT), "-i", str(hosts.key),
                                             hosts.name(i), "hostname; ip -4 -o addr show dev eth0"]),
                             capture_output=True, text=True, timeout=30)
        assert run.returncode == 0, run.stderr + hosts.sshd_log(i)
        name, addr = run.stdout.splitlines()[:2]
        assert name == hosts.name(i)
        assert f" {hosts.net.address(i)}/24 " in addr, addr


@needs_hosts
@pytest.mark.timeout(120)
def test_gloo_job_on_two_hosts_over_ssh(hosts):
    """hvpsrun on host 0, -H host1:1,host2:1: both workers start over ssh on their hosts, run
    gloo_job.py's collectives (checked there against numpy) with Horovod's variables, without MPI."""
    before = [_accepted(hosts, i) for i in range(HOSTS)]
    run = hvpsrun(hosts, ["--gloo", "-H", f"{hosts.name(1)}:1,{hosts.name(2)}:1", sys.executable, GLOO_JOB])
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    reports = {}
    for line in run.stdout.splitlines():
        tagged = TAGGED.match(line)
        assert tagged, f"an untagged line in hvpsrun's stdout: {line!r}"
        if tagged.group(3).startswith("{"):
            report = json.loads(tagged.group(3))
            assert int(tagged.group(1)) == report["rank"], line
            reports[report["rank"]] = report
    assert sorted(reports) == [0, 1], run.stdout + run.stderr
    for rank, report in reports.items():
        host = hosts.name(rank + 1)
        assert report["hostname"] == host, f"rank {rank} did not run on {host}: {report}"
        assert report["horovod"] == {
            "HOROVOD_RANK": str(rank), "HOROVOD_SIZE": "2", "HOROVOD_HOSTNAME": host, "HOROVOD_LOCAL_RANK": "0",
            "HOROVOD_LOCAL_SIZE": "1", "HOROVOD_CROSS_RANK": str(rank), "HOROVOD_CROSS_SIZE": "2"}, report
        assert (report["size"], report["local_rank"], report["local_size"], report["cross_rank"],
                report["cross_size"]) == (2, 0, 1, rank, 2), report
        assert not report["mpi4py"], f"a worker of hvpsrun --gloo imported mpi4py: {report}"
        assert report["restart"] == "0", report
    after = [_accepted(hosts, i) for i in range(HOSTS)]
    assert after[0] == before[0] and after[1] > before[1] and after[2] > before[2], \
        f"ssh logins per host before {before}, after {after}"


class SshElasticJob(ElasticJob):
    """test_elastic_launch's Job (epochs, sizes, bit-exact check), launched on host 0 of the cluster."""

    def __init__(self, hosts: SshCluster, tmp_path: Path, host_lines: str, schedule: dict, flags: list,
                 timeout: float = 120) -> None:
        script = self._prepare(tmp_path, host_lines)
        # the script's own variables, on its command line, so that the test does not depend on how hvpsrun
        # forwards its environment to other hosts (tests/test_gloo_run.py checks that)
        train = ["env", f"SCHEDULE={json.dumps(schedule)}", f"HOSTS_FILE={self.hosts_file}",
                 f"OUT_DIR={tmp_path / 'out'}", sys.executable, TRAIN]
        argv = hvpsrun_argv(hosts, [*flags, "--host-discovery-script", str(script), "--discovery-interval", "0.2",
                                    *train])
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=str(REPO_ROOT),
                                env=_env())
        self._collect(proc, timeout, end=hosts.end_jobs)


@needs_hosts
@pytest.mark.timeout(180)
def test_elastic_kill_of_a_remote_rank_over_ssh(hosts, tmp_path):
    """3 hosts of 1 slot from a discovery script, hvpsrun on host 0: rank 1 (host 1, started over
    ssh) is killed by SIGKILL at epoch 1. Its host is blacklisted, ranks 0 (local) and 2 (over ssh)
    go on from the last commit at size 2, and the final parameters are bit-exact those of the
    uninterrupted run."""
    lines = "\n".join(f"{hosts.name(i)}:1" for i in range(HOSTS))
    job = SshElasticJob(hosts, tmp_path, lines, {"1": {"fail": [1], "how": "kill"}},
                        ["-np", "3", "--min-np", "2", "--network-interface", "eth0"])
    job.assert_exact()
    assert job.sizes() == [3, 2, 2, 2], job.output()
    # the failure is seen through the ssh client: 255 for a remote signal (or hvpsrun ends it, when
    # the survivors' reports of the failed collective come first)
    victim = re.escape(hosts.name(1))
    assert re.search(rf"worker {victim}:0 \(rank 1\) (exited with status 255|was killed by signal 9); "
                     rf"blacklisting host {victim} for good", job.stderr), job.output()
    epochs = job.epochs()
    assert [line[3] for line in epochs[0]] == [hosts.name(i) for i in range(HOSTS)], job.output()
    for lines_ in list(epochs.values())[1:]:
        assert [(line[2], line[3]) for line in lines_] == [(0, hosts.name(0)), (2, hosts.name(2))], \
            "the survivors are the original ranks 0 and 2, alive since the start\n" + job.output()


def _outside_interface():
    """An interface of this machine with a non-loopback IPv4 address, or None."""
    for _, name in socket.if_nameindex():
        address = interface_address(name)
        if address and not address.startswith("127."):
            return name
    return None


@pytest.mark.timeout(120)
@pytest.mark.skipif(_outside_interface() is None, reason="no interface with a non-loopback IPv4 address here")
def test_network_interface_that_is_not_loopback_on_one_host():
    """The elastic test's --network-interface on one machine, without root: rank 0's torch.distributed
    store listens on that interface's address only, and its own client must connect there (it
    connected to 0.0.0.0, i.e. loopback, and timed out)."""
    nic = _outside_interface()
    run = subprocess.run([sys.executable, "-m", "hvps.runner.launch", "--gloo", "-np", "2", "--network-interface", nic,
                          sys.executable, GLOO_JOB], capture_output=True, text=True, timeout=100, cwd=str(REPO_ROOT),
                         env=_env(HVPS_STALL_CHECK_TIME_SECONDS=10))
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    ranks = sorted(json.loads(m.group(3))["rank"] for m in map(TAGGED.match, run.stdout.splitlines())
                   if m and m.group(3).startswith("{"))
    assert ranks == [0, 1], run.stdout
