"""The shared-memory segment's failure paths, in one process: a dead peer, a stalled one, a peer's
abort, ranks lost on the control plane, /dev/shm too small, another user's name (the multi-rank
behaviour is tests/mpi/mpi_shm.py)."""

import os
import threading

import numpy as np
import pytest

from hvps.core.errors import HvpsError
from hvps.dataplane.backends.shm import open_segment
from hvps.dataplane.shm_segment import IN, PID, SHM_DIR, Segment, new_name

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="no /dev/shm")]


class OneRank:
    """The three calls ``open_segment`` makes on a local communicator, for a node of one rank."""

    def Get_rank(self):
        return 0

    def Get_size(self):
        return 1

    def bcast(self, value, root=0):
        return value

    def allgather(self, value):
        return [value]


@pytest.fixture
def segment():
    seg = Segment(new_name(), 2, 0, 4096, timeout=0.3, create=True)
    seg.unlink()
    assert not os.path.exists(seg.path)
    yield seg
    seg.close()


def test_a_dead_peer_is_named(segment):
    with open("/proc/sys/kernel/pid_max") as f:
        segment.header[1, PID] = int(f.read()) + 1  # no such process
    with pytest.raises(HvpsError, match=r"local ranks \[1\] died"):
        segment.wait(IN, 1)
    assert segment.header[2, 0] == 1, "the survivor must tell the other peers (abort flag)"


def test_a_stalled_peer_fails_after_the_stall_time(segment):
    segment.header[1, PID] = os.getpid()  # alive, never arrives
    with pytest.raises(HvpsError, match=r"local ranks \[1\] moved no data for 0.3 s"):
        segment.wait(IN, 1)


def test_ranks_lost_on_the_control_plane_end_the_wait(segment):
    segment.header[1, PID] = os.getpid()  # alive, never arrives; the stall time (0.3 s) is not what ends it
    segment.timeout = 60.0
    segment.lost = threading.Event()
    segment.lost.set()
    with pytest.raises(HvpsError, match="the job lost ranks"):
        segment.wait(IN, 1)
    assert segment.header[2, 0] == 1, "the peers on the node must stop waiting too (abort flag)"


def test_a_peers_abort_ends_the_wait(segment):
    segment.header[1, PID] = os.getpid()
    segment.header[2, 0] = 1
    with pytest.raises(HvpsError, match="another rank on this node failed"):
        segment.wait(IN, 1)


def test_dev_shm_too_small_is_a_reason_not_a_crash():
    segment, reason = open_segment(OneRank(), 1 << 50, 1.0)
    assert segment is None and "MiB free" in reason and "HVPS_RING_CHUNK_BYTES" in reason


def test_a_name_owned_by_someone_else_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr("hvps.dataplane.shm_segment.SHM_DIR", str(tmp_path))
    name = new_name()
    (tmp_path / name).write_bytes(b"")
    with pytest.raises(FileExistsError):
        Segment(name, 2, 0, 4096, timeout=1.0, create=True)


@pytest.mark.parametrize("size", [63, 64, 200])
def test_a_node_of_many_ranks_keeps_the_header_apart_from_the_buffers(size):
    # 64 ranks fill more than a page of header lines: the buffers must start after the last one (the job's
    # line: abort flag and the fast lane's verdicts), not on top of it
    seg = Segment(new_name(), size, 0, 4096, timeout=0.3, create=True)
    seg.unlink()
    try:
        header = seg.header.copy()
        seg.buffer(0, 0, np.uint8, 4096)[...] = 0xFF  # rank 0's first buffer, all ones
        assert np.array_equal(seg.header, header), "rank 0's buffer overwrote header lines"
        seg.buffer(size - 1, 1, np.uint8, 4096)[...] = 0xFF  # the last buffer ends the segment
    finally:
        seg.close()
