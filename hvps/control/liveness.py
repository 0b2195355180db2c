"""Dead peers: a closed control connection is a dead peer, and it is noticed at once.

When a process dies (kill -9, a crash, its host's reboot), its kernel closes its sockets, so the
other end of each of its control connections sees the connection close within milliseconds, even
while every rank's engine thread is blocked inside a data-plane transfer with it. :class:`PeerWatch`
is the thread that notices: it waits in ``poll`` for the peers' *hangups* only (``POLLRDHUP``; it
never reads, so it costs nothing while data flows and never wakes for it) and hands each closed
connection to its owner once. A stopped process (SIGSTOP) keeps its connections open: the data plane's
stall timeout (HVPS_STALL_CHECK_TIME_SECONDS) catches those, and then a roll call names them (below).

Which ranks died, and what every rank then sees:

- a connection that ends without a goodbye frame (``{"bye": ...}``, which ``ControlPlane.close``
  sends) is a dead peer;
- a rank that learns of a loss tells its other peers which ranks were lost (``{"lost": {rank: why}}``)
  and then closes its end, so that a rank whose engine is stuck in a transfer with the dead rank
  learns of it as fast as one that is idle, and names the dead rank, not the messenger; in a
  control-plane tree (``tree.py``) the word floods from the dead rank's neighbours to every rank;
- a rank whose connection to a peer ends without such a notice has lost that peer.

Which ranks stopped (issue 38): when a transfer stalls (``DataPlaneStall``: nothing moved for the stall time),
a rank knows only that its neighbours stopped sending, and a neighbour may itself be waiting for the rank that
stopped. So every worker whose transfer failed reports it to rank 0 (``{"failed": what, "stall": bool}``), and
after a stall (its own or a reported one) rank 0 calls the roll (``ControlPlane.roll_call``): it probes its
children (``{"probe": n}``), which answer from whichever thread next reads their control plane
(``{"alive": n}``); a report counts as an answer. The live ranks stuck in the same transfer stalled at about the
same time, so each leaves it within a grace of the first and reports; a stopped or hung process answers
nothing. The children that neither answered nor reported within the grace are lost (``SILENT``), and rank 0's
notice names them to everyone, as it names dead ranks. A failure that is not a stall (an error of one rank's
own) calls no roll: the ranks waiting for that rank have not stalled yet. In a control-plane tree
(``tree.py``) only rank 0's children are called; a stopped rank below a relay is then not named, and the data
plane's own error stands.

:class:`PeerLost` is the error each outstanding collective then fails with; the engine stops, as a
fixed-size job cannot go on without a rank (hvpsrun ``--max-restarts`` relaunches it; elastic mode
resets the survivors on it).
"""

from __future__ import annotations

import select
import socket
import threading
from typing import Callable, Iterable

from ..core.errors import HvpsError
from ..core.settings import env_choice

#: a peer's end closed (POLLRDHUP, Linux) or the connection failed; POLLHUP and POLLERR are always reported
_HANGUP = getattr(select, "POLLRDHUP", 0x2000)
#: why a rank is lost when its connection closed without a goodbye
CLOSED = "its control connection closed: the process exited or was killed"
#: why a rank is lost when it answered rank 0's roll call neither way after a collective failed in the data plane
SILENT = ("it answered no liveness probe after a collective stalled in the data plane: the process is stopped "
          "(SIGSTOP, a debugger) or hung")


class PeerLost(HvpsError):
    """Ranks died (their control connections closed): every collective in flight fails with this."""

    def __init__(self, lost: dict) -> None:
        self.lost = {int(rank): str(why) for rank, why in sorted(lost.items())}
        super().__init__(f"hvps: {self.who()} {self.what_happened()} ({self.why()}); {self.what_next()}")

    def what_happened(self) -> str:
        """``exited``, or ``stopped answering`` for ranks lost to a roll call (``SILENT``), or both."""
        silent = sum(why == SILENT for why in self.lost.values())
        if not silent:
            return "exited"
        return "stopped answering" if silent == len(self.lost) else "exited or stopped answering"

    def what_next(self) -> str:
        if env_choice("HVPS_ELASTIC", "0", ("0", "1")) == "1":  # hvd.elastic.run recovers in place
            return "the elastic job goes on without " + ("it" if len(self.lost) == 1 else "them")
        return (f"the job cannot go on without {'it' if len(self.lost) == 1 else 'them'}: relaunch it "
                "(hvpsrun --max-restarts N resumes from the last checkpoint)")

    def who(self) -> str:
        ranks = sorted(self.lost)
        if ranks == [0]:
            return "rank 0 (the coordinator)"
        return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"

    def why(self) -> str:
        reasons = sorted(set(self.lost.values()))
        if len(reasons) == 1:
            return reasons[0]
        return "; ".join(f"rank {rank}: {why}" for rank, why in self.lost.items())

    def for_collective(self, kind: str, name: str) -> HvpsError:
        """The error of one collective, naming it and the dead ranks."""
        error = HvpsError(f"hvps: {kind} '{name}' cannot complete: {self.who()} {self.what_happened()} before "
                          f"submitting or finishing it ({self.why()}); {self.what_next()}")
        error.__cause__ = self
        return error


class PeerWatch(threading.Thread):
    """Calls ``on_hangup(key)`` from its own thread, once per connection, as soon as the peer's end
    of it closes (or the connection fails). It never reads the sockets; their owner does.

    ``connections`` are ``(socket, key)`` pairs, fixed for the watch's life. ``stop`` ends it.
    """

    def __init__(self, connections: Iterable, on_hangup: Callable[[object], None],
                 name: str = "hvps-peer-watch") -> None:
        super().__init__(name=name, daemon=True)
        self._on_hangup = on_hangup
        self._poll = select.poll()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._poll.register(self._wake_r, select.POLLIN)
        self._keys: dict = {}
        for sock, key in connections:
            self._keys[sock.fileno()] = key
            self._poll.register(sock, _HANGUP)
        self._stopping = False

    def run(self) -> None:
        try:
            while not self._stopping:
                for fd, _ in self._poll.poll():
                    if fd == self._wake_r.fileno():
                        continue
                    self._poll.unregister(fd)  # level-triggered: report each connection once
                    key = self._keys.pop(fd, None)
                    if key is not None and not self._stopping:
                        self._on_hangup(key)
        finally:
            self._wake_r.close()

    def stop(self) -> None:
        """End the watch (before the sockets are closed, so that no fd is reused under it)."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2)
        self._wake_w.close()
