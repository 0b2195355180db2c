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
#: the most the discovery script may print in one run (a host a line: far more than any cluster needs)
MAX_OUTPUT_BYTES = 1 << 20
#: the longest line of its answer ('host:slots')
MAX_LINE_CHARS = 300


class DiscoveryError(Exception):
    """One run of the discovery script failed (the message says how)."""


def parse_discovery(text: str, slots_per_host: Optional[int] = None) -> list:
    """The hosts a discovery script printed (``host:slots`` or ``host`` per line; ``#`` comments)."""
    hosts: list = []
    for number, raw in enumerate(text.splitlines(), 1):
        if len(raw) > MAX_LINE_CHARS:
            raise DiscoveryError(f"line {number} is {len(raw)} characters long; a line is 'host' or 'host:slots' (at "
                                 f"most {MAX_LINE_CHARS})")
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


def _bounded_run(path: str, timeout: float) -> tuple:
    """``(status, stdout, stderr)`` of the script, reading at most MAX_OUTPUT_BYTES of each stream (more is a
    DiscoveryError, and the script is ended), within ``timeout`` seconds."""
    import os
    import selectors

    try:
        proc = subprocess.Popen([path], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError as exc:
        raise DiscoveryError(f"it cannot be run: {exc.strerror} (is it executable, with a #! line?)") from None
    deadline = time.monotonic() + timeout
    chunks: dict = {proc.stdout: [], proc.stderr: []}
    sizes = {proc.stdout: 0, proc.stderr: 0}
    selector = selectors.DefaultSelector()
    for stream in chunks:
        selector.register(stream, selectors.EVENT_READ)
    try:
        while selector.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                raise DiscoveryError(f"it did not finish within {timeout:g} s")
            for key, _ in selector.select(min(left, 0.5)):
                data = os.read(key.fileobj.fileno(), 65536)
                if not data:
                    selector.unregister(key.fileobj)
                    continue
                sizes[key.fileobj] += len(data)
                if sizes[key.fileobj] > MAX_OUTPUT_BYTES:
                    raise DiscoveryError(f"it printed more than {MAX_OUTPUT_BYTES} bytes; it should print one "
                                         "'host:slots' line per host")
                chunks[key.fileobj].append(data)
        try:
            status = proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            raise DiscoveryError(f"it did not finish within {timeout:g} s") from None
    finally:
        selector.close()
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, 9)
            except OSError:
                pass
            proc.wait()
        proc.stdout.close()
        proc.stderr.close()
    text = [b"".join(chunks[s]).decode("utf-8", "replace") for s in (proc.stdout, proc.stderr)]
    return status, text[0], text[1]


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

    def find(self) -> list:
        returncode, out, err = _bounded_run(self.path, self.timeout)
        if returncode != 0:
            last = (err or "").strip().splitlines()[-1:] or ["(no output on stderr)"]
            raise DiscoveryError(f"it exited with status {returncode}: {last[0][:300]}")
        return parse_discovery(out, self.slots_per_host)

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
