"""The sealed data plane (HVPS_ENCRYPT): its cryptography in process, and real 2- and 3-rank jobs in which
a chunk is damaged on one rank (tests/inner_jobs/encrypted_job.py). The collectives' results under
encryption are checked by tests/test_multirank.py's ``collectives-encrypted`` case."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, _base_env, mpi_launcher

from hvps.core.errors import HvpsError
from hvps.core.settings import Settings
from hvps.runner.mpi_command import build_mpirun_command, launch_environment
from hvps.runner.settings import LaunchSettings

pytest.importorskip("cryptography")
from hvps.dataplane import sealed_crypto  # noqa: E402
from hvps.dataplane.backends import sealed_setup  # noqa: E402

SCRIPT = Path(__file__).resolve().parent / "inner_jobs" / "encrypted_job.py"
STALL = 10.0


class FakeComm:
    """Two ranks' view of an allgather, for the key exchange in one process."""

    def __init__(self, rank: int, entries: list) -> None:
        self.rank, self.entries = rank, entries

    def Get_rank(self):  # noqa: N802
        return self.rank

    def allgather(self, obj):
        self.entries[self.rank] = obj
        return list(self.entries)


def _pair(secret=None):
    """Keyrings of ranks 0 and 1 that exchanged keys (both public keys drawn before either agrees)."""
    import threading

    entries = [None, None]
    rings = [None, None]
    barrier = threading.Barrier(2)

    class Comm(FakeComm):
        def allgather(self, obj):
            self.entries[self.rank] = obj
            barrier.wait()
            return list(self.entries)

    threads = [threading.Thread(target=lambda r=r: rings.__setitem__(r, sealed_crypto.agree(Comm(r, entries), secret)))
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return rings


def test_both_ends_derive_the_same_key_per_direction_and_different_keys_per_direction():
    a, b = _pair()
    assert a.key(0, 1, b"c") == b.key(0, 1, b"c")
    assert a.key(1, 0, b"c") == b.key(1, 0, b"c")
    assert a.key(0, 1, b"c") != a.key(1, 0, b"c")
    assert a.key(0, 1, b"c") != a.key(0, 1, b"d")  # each communicator its own keys


def test_a_sealed_chunk_opens_only_with_its_nonce_and_associated_data():
    a, b = _pair(secret=b"s" * 32)
    send = sealed_crypto.Direction(a.key(0, 1, b"c"), 0, 1)
    recv = sealed_crypto.Direction(b.key(0, 1, b"c"), 0, 1)
    plain = os.urandom(1000)
    sealed = bytearray(len(plain) + sealed_crypto.TAG)
    send.seal_into(send.next_nonce(), plain, sealed, sealed_crypto.aad(1, 7, 1, 0, 1000))
    assert plain not in bytes(sealed)
    out = bytearray(1000)
    nonce = recv.next_nonce()
    for nonce_, aad in ((nonce, sealed_crypto.aad(1, 8, 1, 0, 1000)),   # another collective
                        (nonce, sealed_crypto.aad(1, 7, 1, 1, 1000)),   # another chunk
                        (recv.next_nonce(), sealed_crypto.aad(1, 7, 1, 0, 1000))):  # a replay: the counter moved on
        with pytest.raises(sealed_crypto.invalid_tag()):
            recv.open_into(nonce_, bytes(sealed), out, aad)
    recv.open_into(nonce, bytes(sealed), out, sealed_crypto.aad(1, 7, 1, 0, 1000))
    assert bytes(out) == plain
    assert len({send.next_nonce() for _ in range(1000)}) == 1000


def test_a_public_key_without_the_secrets_hmac_is_refused():
    entries = [(0, b"k" * 32, b"j" * 16, b"forged"), None]
    with pytest.raises(HvpsError, match="rank 0's public key fails the job secret's HMAC"):
        sealed_crypto.agree(FakeComm(1, entries), b"s" * 32)


def test_data_planes_that_send_in_clear_are_refused():
    settings = Settings(backend="tdist", encrypt="1")
    with pytest.raises(HvpsError, match="cannot seal HVPS_BACKEND=tdist.*HVPS_BACKEND=mpi"):
        sealed_setup.plan(settings, FakeComm(0, [None]), FakeComm(0, [None]), None)


def test_off_builds_nothing():
    assert sealed_setup.plan(Settings(), FakeComm(0, [None]), FakeComm(0, [None]), None) is None


def _run(tmp: Path, np_: int, env: dict) -> str:
    env = _base_env(dict(env, OUT=str(tmp), HVPS_STALL_CHECK_TIME_SECONDS=str(STALL), HVPS_ENCRYPT="all",
                         HVPS_RING_CHUNK_BYTES="262144"))
    settings = LaunchSettings(command=(sys.executable, str(SCRIPT)), num_proc=np_)
    cmd = build_mpirun_command(settings, env, mpi=mpi_launcher(), hosts=[])
    env = launch_environment(settings, env, np_, [], os.cpu_count() or 1)
    proc = subprocess.run(cmd, cwd=str(REPO_ROOT), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          timeout=90)
    return proc.stdout.decode(errors="replace")


JOBS = [(2, "flip"), (3, "flip"), (2, "replay"), (3, "replay")]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_,mode", JOBS, ids=[f"np{n}-{m}" for n, m in JOBS])
def test_a_damaged_chunk_fails_the_collective_on_every_rank_naming_the_peer(tmp_path, np_, mode):
    out = _run(tmp_path, np_, {"MODE": mode})
    assert "NO ERROR" not in out, out
    victim = np_ - 1
    for rank in range(np_):
        record = tmp_path / f"err.{rank}"
        assert record.exists(), f"rank {rank} never raised:\n{out}"
        seconds, message = record.read_text().split("\n", 1)
        print(f"np={np_} {mode}: rank {rank} raised after {float(seconds):.3f} s: {message}")
        assert float(seconds) < STALL, message
        assert "allreduce" in message, message
        assert f"from rank {victim - 1} failed authentication on rank {victim}" in message, message


@pytest.mark.timeout(120)
def test_a_rank_started_without_the_setting_fails_init_on_every_rank(tmp_path):
    out = _run(tmp_path, 2, {"MODE": "mismatch"})
    assert "NO ERROR" not in out, out
    for rank in range(2):
        record = tmp_path / f"err.{rank}"
        assert record.exists(), f"rank {rank} never raised:\n{out}"
        message = record.read_text()
        assert "HVPS_ENCRYPT differs between ranks" in message and "ranks [1] would send in clear" in message, message


SECRET_A, SECRET_B = "ab" * 32, "cd" * 32


@pytest.mark.timeout(120)
@pytest.mark.parametrize("np_", [2, 3])
def test_under_mpirun_every_rank_checks_that_all_hold_the_same_secret(tmp_path, np_):
    """Issue 38: under mpirun HVPS_SECRET was ignored, and ranks with different secrets ran (rc 0), their sealed
    plane's key exchange unauthenticated. Now the last rank's different secret fails init on every rank."""
    out = _run(tmp_path, np_, {"MODE": "secret", **{f"SECRET_{r}": SECRET_A for r in range(np_ - 1)},
                               f"SECRET_{np_ - 1}": SECRET_B})
    for rank in range(np_):
        record = tmp_path / f"err.{rank}"
        assert record.exists(), f"rank {rank} never raised:\n{out}"
        message = record.read_text()
        assert "job secret (HVPS_SECRET/HVPS_SECRET_FILE) differs from that of ranks" in message, message
        assert f"ranks [{np_ - 1}]" in message if rank < np_ - 1 else f"ranks {list(range(np_ - 1))}" in message


@pytest.mark.timeout(120)
def test_under_mpirun_the_same_secret_binds_the_key_exchange_and_an_unsafe_file_is_refused(tmp_path):
    """The same HVPS_SECRET on every rank: the sealed plane runs with the secret's keys; a secret file that
    others may read fails init on every rank."""
    out = _run(tmp_path, 2, {"MODE": "secret", "SECRET_0": SECRET_A, "SECRET_1": SECRET_A})
    for rank in range(2):
        assert (tmp_path / f"ok.{rank}").read_text() == "mpi True True", out
    secret = tmp_path / "secret"
    secret.write_text(SECRET_A + "\n")
    secret.chmod(0o644)
    out = _run(tmp_path, 2, {"MODE": "secret", "HVPS_SECRET_FILE": str(secret)})
    for rank in range(2):
        message = (tmp_path / f"err.{rank}").read_text()
        assert "may be read or written by others (mode -rw-r--r--); chmod 600" in message, out


@pytest.mark.unit
def test_a_secret_file_that_is_not_a_regular_file_of_this_user_is_refused(tmp_path, monkeypatch):
    import time

    from hvps.runtime.bootstrap import read_secret

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)
    link = tmp_path / "link"
    good = tmp_path / "good"
    good.write_text(SECRET_A + "\n")
    good.chmod(0o600)
    link.symlink_to(good)
    monkeypatch.delenv("HVPS_SECRET", raising=False)
    began = time.monotonic()
    for path, needle in ((fifo, "is not a regular file"), (link, "cannot be read"),
                         (tmp_path / "none", "cannot be read")):
        monkeypatch.setenv("HVPS_SECRET_FILE", str(path))
        with pytest.raises(HvpsError, match=needle):
            read_secret()
    assert time.monotonic() - began < 5, "a FIFO must not block"
    monkeypatch.setenv("HVPS_SECRET_FILE", str(good))
    assert read_secret() == SECRET_A.encode()
    if os.getuid() == 0:
        os.chown(good, 65534, -1)
        with pytest.raises(HvpsError, match="belongs to user 65534"):
            read_secret()


@pytest.mark.parametrize("flag,value", [("--encrypt", "1"), ("--encrypt-all", "all")])
def test_hvpsrun_flags_set_the_variable(flag, value):
    from hvps.runner.settings import parse_args

    assert parse_args(["-np", "2", flag, "python", "train.py"]).hvps_env()["HVPS_ENCRYPT"] == value
    assert "HVPS_ENCRYPT" not in parse_args(["-np", "2", "python", "train.py"]).hvps_env()


def test_the_chunk_by_chunk_fold_gives_the_whole_folds_bits_and_stops_at_a_failure():
    """The sealed reduce-scatter folds its last step's chunks as they open (backends/sealed.py's ChunkFold):
    in rank order, bit for bit the fold of the whole block, also where a chunk's bytes split an element;
    and nothing more is folded once a chunk of the collective failed to open."""
    import numpy as np

    from hvps.dataplane.backends.sealed import ChunkFold
    from hvps.dataplane.schedule import fold_in_rank_order

    rng = np.random.default_rng(42)
    parts = (rng.standard_normal((3, 1001)) * 10.0 ** rng.integers(-8, 8, (3, 1001))).astype(np.float32)
    whole = np.empty(1001, np.float32)
    fold_in_rank_order(np.add, list(parts), whole)
    for chunk in (1030, 4000, 4002, 1 << 20):  # bytes: 1030 and 4002 split float32 elements
        out = np.full(1001, np.nan, np.float32)
        fold = ChunkFold(np.add, parts, out, {})
        for stop in range(chunk, parts[0].nbytes + chunk, chunk):
            fold.upto(min(stop, parts[0].nbytes))
        assert out.tobytes() == whole.tobytes(), chunk
    state: dict = {}
    out = np.zeros(1001, np.float32)
    fold = ChunkFold(np.add, parts, out, state)
    fold.upto(2000)
    state["failure"] = "a chunk from rank 1 failed authentication"
    fold.upto(parts[0].nbytes)
    assert out[:500].tobytes() == whole[:500].tobytes() and not out[500:].any()
