"""Where an elastic job may run: the host discovery script's answer, and the hosts blacklisted after a failure.

Horovod's conventions (``horovod/runner/elastic/discovery.py``, ``docs/elastic.rst``):

- the script prints one host per line, ``host:slots`` or ``host`` (then ``--slots-per-host``, else 1);
  an empty answer means no host is available now;
- a script that fails, hangs (longer than :data:`SCRIPT_TIMEOUT`) or prints garbage is retried; after
  :data:`SCRIPT_ATTEMPTS` failures in a row the job fails with the script's own message;
- a host on which a worker failed is blacklisted: for good, or with ``--blacklist-cooldown-range MIN
  MAX`` for a cool-down that doubles with each failure of that host (MIN, 2·MIN, ... up to MAX, with
  jitter), after which the host may be used again.
"""

from __future__ import annotations

import random
import subprocess
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from .errors import LaunchError
from .hosts import Host, parse_hosts

#: seconds one run of the discovery script may take
SCRIPT_TIMEOUT = 10.0
#: runs of the discovery script that may fail in a row before the job fails
SCRIPT_ATTEMPTS = 3


class DiscoveryError(Exception):
    """One run of the discovery script failed (the message says how)."""


def parse_discovery(text: str, slots_per_host: Optional[int] = None) -> list:
    """The hosts a discovery script printed (``host:slots`` or ``host`` per line; ``#`` comments)."""
    hosts: list = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        try:
            (host,) = parse_hosts(line)
        except (LaunchError, ValueError) as exc:
            raise DiscoveryError(f"line {number} ({raw.strip()!r}) is not 'host' or 'host:slots': {exc}") from None
        explicit = line.rsplit(":", 1)[-1].isdigit() and not line.endswith("]")
        slots = host.slots if explicit else (slots_per_host or 1)
        hosts.append(Host(host.name, slots))
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise DiscoveryError(f"it lists a host twice ({sorted({n for n in names if names.count(n) > 1})})")
    return hosts


@dataclass
class FixedHosts:
    """The hosts of ``-H``/``--hostfile``: fault tolerance without scaling."""

    hosts: Sequence[Host]

    def find(self) -> list:
        return list(self.hosts)

    def describe(self) -> str:
        return "-H"


@dataclass
class DiscoveryScript:
    """``--host-discovery-script``: run it, parse its answer."""

    path: str
    slots_per_host: Optional[int] = None
    timeout: float = SCRIPT_TIMEOUT
    run: Callable = subprocess.run

    def find(self) -> list:
        try:
            done = self.run([self.path], capture_output=True, text=True, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"it did not finish within {self.timeout:g} s") from None
        except OSError as exc:
            raise DiscoveryError(f"it cannot be run: {exc.strerror} (is it executable, with a #! line?)") from None
        if done.returncode != 0:
            last = (done.stderr or "").strip().splitlines()[-1:] or ["(no output on stderr)"]
            raise DiscoveryError(f"it exited with status {done.returncode}: {last[0]}")
        return parse_discovery(done.stdout, self.slots_per_host)

    def describe(self) -> str:
        return f"--host-discovery-script {self.path}"


@dataclass
class Discovery:
    """A source of hosts, retried: ``find()`` gives the last good answer while fewer than
    :data:`SCRIPT_ATTEMPTS` runs in a row failed, then raises LaunchError with the last reason."""

    source: object
    attempts: int = SCRIPT_ATTEMPTS
    failures: int = 0
    last: Optional[list] = None

    def find(self) -> Optional[list]:
        """The hosts now; None while the source is failing and no answer was ever good."""
        try:
            self.last = self.source.find()
            self.failures = 0
        except DiscoveryError as exc:
            self.failures += 1
            if self.failures >= self.attempts:
                raise LaunchError(f"{self.source.describe()} failed {self.failures} times in a row; the last "
                                  f"time {exc}. Fix the script (it prints lines 'host:slots')") from None
        return self.last


@dataclass
class Blacklist:
    """Hosts on which a worker failed. Without ``cooldown`` a host stays out for good; with
    ``cooldown=(MIN, MAX)`` it comes back after MIN·2^(failures-1) seconds (at most MAX, jitter ±20%)."""

    cooldown: Optional[tuple] = None
    clock: Callable[[], float] = time.monotonic
    rand: Callable[[], float] = random.random
    _until: dict = field(default_factory=dict)  # host -> when it may be used again (inf: never)
    _failures: dict = field(default_factory=dict)

    def add(self, host: str) -> float:
        """Blacklist ``host``; the seconds it stays out (inf: for good)."""
        self._failures[host] = self._failures.get(host, 0) + 1
        if self.cooldown is None:
            delay = float("inf")
        else:
            low, high = self.cooldown
            delay = min(high, low * 2 ** (self._failures[host] - 1)) * (0.8 + 0.4 * self.rand())
        self._until[host] = self.clock() + delay
        return delay

    def blocked(self, host: str) -> bool:
        return self.clock() < self._until.get(host, float("-inf"))

    def permanent(self, host: str) -> bool:
        return self._until.get(host) == float("inf")

    def failures(self, host: str) -> int:
        return self._failures.get(host, 0)
