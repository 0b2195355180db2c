"""An emulated multi-host cluster for tests: network namespaces as hosts.

A thin Python handle on ``jobs/testbed/netns-cluster.sh`` (the one implementation):
``up()`` creates the namespaces, the bridge, the veth pairs and the tc rate limits;
``down()`` ends the processes still running inside this cluster's namespaces (by
pid, from ``ip netns pids``: only processes the tests started there) and removes
everything ``up()`` created. Addresses come from 198.18.0.0/15; nothing here sends
traffic anywhere but the bridge and loopback.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Optional

REPO_ROOT = Path(__file__).resolve().parent.parent
SCRIPT = REPO_ROOT / "jobs" / "testbed" / "netns-cluster.sh"


def unavailable_reason() -> Optional[str]:
    """Why namespaces cannot be used here, or None when they can (probes by creating one)."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN and CAP_SYS_ADMIN)"
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            return f"'{tool}' is missing (apt-get install iproute2 util-linux)"
    probe = f"hvprobe{os.getpid() % 10000}"
    proc = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if proc.returncode != 0:
        return f"'ip netns add' fails here: {proc.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def netem_available() -> bool:
    """Whether the kernel has the netem qdisc (delay emulation)."""
    probe = f"hvnetem{os.getpid() % 10000}"
    subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=True)
    try:
        proc = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "1ms"], capture_output=True)
        return proc.returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


class NetnsCluster:
    """``hosts`` namespaces named ``<prefix>-h<i>`` with addresses ``<subnet>.<i+1>``."""

    def __init__(self, hosts: int = 2, *, prefix: Optional[str] = None, subnet: Optional[str] = None,
                 rate: str = "1gbit", delay: str = "0", slots: int = 1, state_dir: Optional[str] = None) -> None:
        pid = os.getpid()
        self.hosts = hosts
        self.prefix = prefix or f"hvt{pid % 100000}"
        self.subnet = subnet or f"198.18.{pid % 250 + 1}"
        self.rate = rate
        self.delay = delay
        self.slots = slots
        self.state = Path(state_dir or f"/run/hvps-testbed/{self.prefix}")
        self.is_up = False

    # -- lifecycle --------------------------------------------------------------------
    def _env(self) -> dict:
        env = dict(os.environ)
        env.update(TB_HOSTS=str(self.hosts), TB_PREFIX=self.prefix, TB_SUBNET=self.subnet, TB_RATE=self.rate,
                   TB_DELAY=self.delay, TB_SLOTS=str(self.slots), TB_STATE=str(self.state))
        return env

    def _script(self, *args: str) -> str:
        proc = subprocess.run(["bash", str(SCRIPT), *args], env=self._env(), capture_output=True, text=True,
                              timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(f"netns-cluster.sh {' '.join(args)} failed ({proc.returncode}):\n"
                               f"{proc.stdout}{proc.stderr}")
        return proc.stdout

    def up(self) -> "NetnsCluster":
        self._script("up")
        self.is_up = True
        return self

    def namespace(self, i: int) -> str:
        return f"{self.prefix}-h{i}"

    def pids(self) -> list:
        """Processes running inside this cluster's namespaces."""
        found = []
        for i in range(self.hosts):
            proc = subprocess.run(["ip", "netns", "pids", self.namespace(i)], capture_output=True, text=True)
            found += [int(p) for p in proc.stdout.split()]
        return found

    def kill_processes(self, grace: float = 2.0) -> None:
        """SIGTERM, then SIGKILL, every process inside our namespaces (all were started by the tests)."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and self.pids():
                time.sleep(0.1)

    def down(self) -> None:
        self.kill_processes()
        self._script("down")
        self.is_up = False

    def __enter__(self) -> "NetnsCluster":
        return self.up()

    def __exit__(self, *exc) -> None:
        self.down()

    # -- what launches need ---------------------------------------------------------
    @property
    def hostfile(self) -> Path:
        return self.state / "hostfile"

    @property
    def agent(self) -> Path:
        return self.state / "rsh-agent"

    @property
    def mpi_args(self) -> str:
        return (self.state / "mpirun-args").read_text().strip()

    def address(self, i: int) -> str:
        return f"{self.subnet}.{i + 1}"

    def hostname(self, i: int) -> str:
        return f"{self.prefix}-node{i}"

    def ompi_env(self) -> dict:
        """Open MPI settings as environment variables, for launchers that cannot take flags:
        the default hostfile, the rsh agent and TCP-only transports on the bridge subnet.
        Open MPI 4 reads its runtime's settings as OMPI_MCA_orte_*/plm/oob; Open MPI 5's
        runtime (PRRTE) reads PRTE_MCA_*, so both spellings are given."""
        net = f"{self.subnet}.0/24"
        hostfile, agent = str(self.hostfile), str(self.agent)
        return {
            "OMPI_MCA_btl": "tcp,self",
            "OMPI_MCA_btl_tcp_if_include": net,
            # Open MPI 4 (ORTE)
            "OMPI_MCA_orte_default_hostfile": hostfile,
            "OMPI_MCA_plm_rsh_agent": agent,
            "OMPI_MCA_oob_tcp_if_include": net,
            # Open MPI 5 (PRRTE), where the rsh agent is called the ssh agent
            "PRTE_MCA_prte_default_hostfile": hostfile,
            "PRTE_MCA_plm_ssh_agent": agent,
            "PRTE_MCA_oob_tcp_if_include": net,
        }

    # -- faults and links -----------------------------------------------------------
    def cut(self, i: int) -> None:
        """Take host i's link down (its bridge-side veth): packets to and from it are dropped."""
        subprocess.run(["ip", "link", "set", f"{self.prefix}-v{i}", "down"], check=True)

    def restore(self, i: int) -> None:
        subprocess.run(["ip", "link", "set", f"{self.prefix}-v{i}", "up"], check=True)

    def set_rate(self, rate: str) -> None:
        self.rate = rate
        self._script("set-rate", rate)

    def run_in(self, i: int, argv: list, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.namespace(i), *argv], **kwargs)

    def popen_in(self, i: int, argv: list, **kwargs) -> subprocess.Popen:
        return subprocess.Popen(["ip", "netns", "exec", self.namespace(i), *argv], **kwargs)
