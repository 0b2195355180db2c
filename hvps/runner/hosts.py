"""Host lists (``-H host1:2,host2:2``), hostfiles (``host slots=N``) and their checks."""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass
from typing import Callable, Iterable, Optional

from .errors import LaunchError

LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "localhost.localdomain"})
_HOSTFILE_LINE = re.compile(r"^(?P<host>\S+)(?:\s+(?:slots|max_slots|max-slots)\s*=\s*(?P<slots>\S+))?\s*$")


@dataclass(frozen=True)
class Host:
    name: str
    slots: int

    @property
    def is_ipv6(self) -> bool:
        return ":" in self.name

    def spec(self) -> str:
        """``host:slots``, with an IPv6 literal in brackets: ``[::1]:2``."""
        return f"[{self.name}]:{self.slots}" if self.is_ipv6 else f"{self.name}:{self.slots}"


#: the most slots one host may have (a bigger number is a typo, not a machine)
MAX_SLOTS = 1 << 16
#: the largest hostfile hvpsrun reads
MAX_HOSTFILE_BYTES = 1 << 20
_NAME_CHARS = re.compile(r"^[A-Za-z0-9_.:%\[\]-]+$")


def check_name(name: str, where: str) -> str:
    """``name`` when it can only be a host name: never an option of ssh or mpirun (a leading ``-``), no
    spaces or control characters, at most 255 characters; LaunchError otherwise."""
    if name.startswith("-"):
        raise LaunchError(f"{where}: host name {name[:80]!r} starts with '-' (ssh and mpirun would read it as an "
                          "option); give the host's name or address")
    if len(name) > 255 or not _NAME_CHARS.match(name):
        raise LaunchError(f"{where}: {name[:80]!r} is not a host name (letters, digits, '.', '-', '_', at most 255; "
                          "an IPv6 address in brackets)")
    return name


def _slots(text: str, where: str) -> int:
    if not text.isdigit() or len(text) > 6:
        try:
            int(text)
        except ValueError:
            raise LaunchError(f"{where}: slots {text!r} is not a whole number; write e.g. host1:2") from None
    slots = int(text)
    if slots < 1:
        raise LaunchError(f"{where}: slots must be >= 1")
    if slots > MAX_SLOTS:
        raise LaunchError(f"{where}: {text[:40]} slots is more than one host can have (at most {MAX_SLOTS})")
    return slots


def _merge(hosts: Iterable[Host]) -> list:
    """Merge repeated hosts (adding slots), keeping first-seen order."""
    merged: dict = {}
    for host in hosts:
        merged[host.name] = merged.get(host.name, 0) + host.slots
    return [Host(name, slots) for name, slots in merged.items()]


def parse_hosts(spec: str) -> list:
    """``host1:2,host2:2`` -> [Host('host1', 2), Host('host2', 2)]; a host without ``:N`` has 1 slot."""
    hosts = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, sep, slots = item.rpartition(":")
        if not sep or not name or "]" in slots:  # 'host' or '[::1]'
            name, slots = item, "1"
        elif ":" in name and not (name.startswith("[") and name.endswith("]")):
            raise LaunchError(f"-H {item}: write an IPv6 address in brackets, e.g. [{item}]:1 or [::1]:2")
        check_name(name, f"-H {item[:80]}")
        hosts.append(Host(name.strip("[]"), _slots(slots, f"-H {item[:80]}")))
    if not hosts:
        raise LaunchError(f"-H {spec!r} names no host; write e.g. -H host1:2,host2:2")
    return _merge(hosts)


def parse_hostfile_text(text: str, path: str = "<hostfile>") -> list:
    """Lines ``host slots=N`` (or ``host``); ``#`` starts a comment."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = _HOSTFILE_LINE.match(line)
        if not match:
            raise LaunchError(f"{path}:{number}: cannot read {raw.strip()!r}; write lines like 'host1 slots=2'")
        check_name(match["host"], f"{path}:{number}")
        hosts.append(Host(match["host"].strip("[]"), _slots(match["slots"] or "1", f"{path}:{number}")))
    if not hosts:
        raise LaunchError(f"hostfile {path} lists no host; write lines like 'host1 slots=2'")
    return _merge(hosts)


def parse_hostfile(path: str) -> list:
    """The hosts of a hostfile: a regular file of at most MAX_HOSTFILE_BYTES (a FIFO would hang the launch,
    /dev/zero would fill the memory)."""
    from hvps.core.files import RefusedFile, read_untrusted

    try:
        data = read_untrusted(path, MAX_HOSTFILE_BYTES + 1)
    except RefusedFile as exc:
        what = "give a file of lines 'host slots=N'" if not exc.missing else "check --hostfile"
        raise LaunchError(f"--hostfile {path} {exc.reason}; {what}") from None
    if len(data) > MAX_HOSTFILE_BYTES:
        raise LaunchError(f"--hostfile {path} holds more than a hostfile's {MAX_HOSTFILE_BYTES} bytes; give a file "
                          "of lines 'host slots=N'")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise LaunchError(f"--hostfile {path} is not UTF-8 text; give a file of lines 'host slots=N'") from None
    return parse_hostfile_text(text, path)


def resolve_hosts(hosts_spec: Optional[str], hostfile: Optional[str]) -> list:
    """The hosts given by -H or --hostfile; [] means this machine only."""
    if hosts_spec:
        return parse_hosts(hosts_spec)
    if hostfile:
        return parse_hostfile(hostfile)
    return []


def local_names() -> set:
    names = set(LOCAL_NAMES)
    try:
        names.add(socket.gethostname())
        names.add(socket.getfqdn())
    except OSError:
        pass
    return names


def is_local_only(hosts: list, local: Optional[set] = None) -> bool:
    """Whether every host is this machine (or no host was given)."""
    local = local_names() if local is None else local
    return all(h.name in local for h in hosts)


def check_resolvable(hosts: list, resolve: Callable = socket.getaddrinfo) -> None:
    """Raise LaunchError for the first host name that does not resolve."""
    for host in hosts:
        try:
            resolve(host.name, None)
        except (socket.gaierror, UnicodeError):
            raise LaunchError(
                f"unknown host '{host.name}': it does not resolve; fix the name in -H/--hostfile "
                "or add it to DNS or /etc/hosts"
            ) from None


def check_slots(hosts: list, num_proc: int) -> None:
    total = sum(h.slots for h in hosts)
    if num_proc > total:
        listed = ",".join(h.spec() for h in hosts)
        raise LaunchError(
            f"-np {num_proc} is more than the {total} slots of {listed}; lower -np or give the hosts more "
            "slots (host:N or 'host slots=N')"
        )


def hosts_arg(hosts: list) -> str:
    return ",".join(h.spec() for h in hosts)


def hostfile_text(hosts: list) -> str:
    """Open MPI's hostfile for ``hosts``: ``host slots=N`` lines, IPv6 literals bare (as it parses them)."""
    return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)


def ranks_per_host(hosts: list, num_proc: int) -> list:
    """How ``-map-by slot`` fills the hosts: each host's slots in order, until num_proc ranks are placed."""
    placed, left = [], num_proc
    for host in hosts:
        take = min(host.slots, left)
        placed.append(take)
        left -= take
    return placed
