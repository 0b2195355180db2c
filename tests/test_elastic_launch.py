"""hvpsrun's elastic mode (issue 24): Horovod's elastic integration scenarios, each with real worker
processes started by a real hvpsrun, on this machine's names (``localhost``, ``127.0.0.1`` and the
hostname stand for three hosts, as in Horovod's own tests), plus Horovod issues 3494 and 3852.

Every scenario runs ``tests/inner_jobs/elastic_train.py``: its final parameters must be bit-exact
those of the uninterrupted one-process reference (every step applied exactly once, whatever failed or
changed); the per-epoch log lines show the sizes and rendezvous counts. Then the driver's parts alone
(discovery, blacklist, rank assignment) and bad input."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import socket
import subprocess
import sys
import threading

import pytest
from conftest import REPO_ROOT

from hvps.runner.discovery import Blacklist, Discovery, DiscoveryError, DiscoveryScript, parse_discovery
from hvps.runner.elastic_run import assign
from hvps.runner.errors import LaunchError
from hvps.runner.hosts import Host
from hvps.runner.launch import prepare
from hvps.runner.settings import parse_args

TRAIN = str(REPO_ROOT / "tests" / "inner_jobs" / "elastic_train.py")
KERAS_FIT = str(REPO_ROOT / "tests" / "inner_jobs" / "elastic_keras_fit.py")
KERAS_TRAIN = str(REPO_ROOT / "tests" / "inner_jobs" / "elastic_keras_train.py")
HOST = socket.gethostname()
THREE_HOSTS = f"localhost:1\n127.0.0.1:1\n{HOST}:1"


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMIX_", "PMI_", "HVPS_", "PRTE_"))}
    env.update(PYTHONPATH=str(REPO_ROOT), PYTHONUNBUFFERED="1", HVPS_STALL_CHECK_TIME_SECONDS="30")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _inner_job(path: str):
    """An inner job's module, loaded here (its ``reference()``: the uninterrupted run, in this process)."""
    spec = importlib.util.spec_from_file_location(f"inner_{os.path.basename(path)[:-3]}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@functools.lru_cache(maxsize=None)
def _reference(epochs: int) -> list:
    """The uninterrupted one-process run's final parameters (once per session and epoch count), as JSON
    has them."""
    return json.loads(json.dumps(_inner_job(TRAIN).reference(epochs)))


class Job:
    """One elastic hvpsrun job: its hosts file, discovery script, output and result."""

    def __init__(self, tmp_path, hosts: str, schedule: dict = None, flags=(), discovery: bool = True,
                 on_stderr=None, timeout: float = 120, script: str = TRAIN, **env) -> None:
        discover = self._prepare(tmp_path, hosts)
        args = [sys.executable, "-m", "hvps.runner.launch", *flags]
        if discovery:
            args += ["--host-discovery-script", str(discover), "--discovery-interval", "0.2"]
        proc = subprocess.Popen(args + [sys.executable, script], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=str(REPO_ROOT),
                                env=_env(SCHEDULE=json.dumps(schedule or {}), HOSTS_FILE=self.hosts_file,
                                         OUT_DIR=tmp_path / "out", **env))
        self._collect(proc, timeout, on_stderr)

    def _prepare(self, tmp_path, hosts: str):
        """The hosts file, the discovery script that prints it (returned) and the output folder."""
        self.dir = tmp_path
        self.hosts_file = tmp_path / "hosts"
        self.hosts_file.write_text(hosts + "\n")
        discover = tmp_path / "discover.sh"
        discover.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        discover.chmod(0o755)
        (tmp_path / "out").mkdir()
        return discover

    def _collect(self, proc, timeout: float, on_stderr=None, end=None) -> None:
        """Read the job's output until it exits; after ``timeout`` s end it (``end()``, default: kill
        hvpsrun) and fail the test."""
        self.stderr_lines: list = []
        self.stdout_lines: list = []

        def read(stream, lines, callback):
            for line in stream:
                lines.append(line)
                if callback is not None:
                    callback(self, line)

        readers = [threading.Thread(target=read, args=args, daemon=True)
                   for args in ((proc.stdout, self.stdout_lines, None), (proc.stderr, self.stderr_lines, on_stderr))]
        for reader in readers:
            reader.start()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            (end or proc.kill)()
            proc.wait()
            pytest.fail(f"the elastic job hung for {timeout} s:\n{self.output()}")
        finally:
            for reader in readers:
                reader.join(5)
        self.rc = proc.returncode

    @property
    def stdout(self) -> str:
        return "".join(self.stdout_lines)

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def output(self) -> str:
        return f"exit {self.rc}\n--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-6000:]}"

    def epochs(self) -> list:
        """The per-epoch lines, {epoch: [(rank, size, start_rank, host, rendezvous), ...]} sorted."""
        found: dict = {}
        for line in self.stdout.splitlines():
            text = line.split(">:", 1)[-1]
            if text.startswith('{"epoch"'):
                r = json.loads(text)
                found.setdefault(r["epoch"], []).append((r["rank"], r["size"], r["start_rank"], r["host"],
                                                         r["rendezvous"]))
        return {epoch: sorted(lines) for epoch, lines in sorted(found.items())}

    def sizes(self) -> list:
        return [lines[0][1] for lines in self.epochs().values()]

    def assert_exact(self, epochs: int = 4) -> None:
        assert self.rc == 0, self.output()
        final = json.loads((self.dir / "out" / "final.json").read_text())
        assert final == _reference(epochs), f"final parameters differ from the uninterrupted run\n{self.output()}"
        assert sorted(self.epochs()) == list(range(epochs)), self.output()
        for lines in self.epochs().values():  # each epoch logged once by every rank of its size
            assert [rank for rank, *_ in lines] == list(range(lines[0][1])), self.output()


# -- Horovod's integration scenarios (test/integration/elastic_common.py) ----------------------------

def test_hosts_added_and_removed(tmp_path):
    """2 slots, a host added (3 ranks), the oldest host removed (1 rank): 3 rendezvous, every step once."""
    job = Job(tmp_path, "localhost:2", {"1": {"hosts": "localhost:2\n127.0.0.1:1"}, "2": {"hosts": "127.0.0.1:1"}},
              ["-np", "2", "--min-np", "1"])
    job.assert_exact()
    assert job.sizes() == [2, 3, 1, 1], job.output()
    epochs = job.epochs()
    assert epochs[1][2][2:] == (2, "127.0.0.1", 2), "the new host's worker starts as rank 2 in rendezvous 2"
    assert epochs[2] == [(0, 1, 2, "127.0.0.1", 3)], "after the oldest host left, its worker is rank 0"
    assert "has no place in the job's membership 3" in job.stderr, job.output()


@pytest.mark.parametrize("how", ["kill", "raise"])
def test_single_rank_failure(tmp_path, how):
    """Rank 1 of 3 fails (kill -9, or an exception out of the training function): its host is
    blacklisted and the other two go on from the last commit, with no restart."""
    job = Job(tmp_path, THREE_HOSTS, {"1": {"fail": [1], "how": how}}, ["-np", "3", "--min-np", "2"])
    job.assert_exact()
    assert job.sizes() == [3, 2, 2, 2], job.output()
    assert "blacklisting host 127.0.0.1 for good" in job.stderr, job.output()
    survivors = {line[2] for lines in list(job.epochs().values())[1:] for line in lines}
    assert survivors == {0, 2}, "the survivors are the original ranks 0 and 2, alive since the start"


def test_stopped_worker_is_caught_by_the_stall_timeout_and_ended(tmp_path):
    """SIGSTOP keeps a worker's connections open: the others' collective fails after the stall time,
    they report it, and hvpsrun ends the worker that did not (then blacklists its host)."""
    job = Job(tmp_path, THREE_HOSTS, {"1": {"fail": [1], "how": "stop"}}, ["-np", "3", "--min-np", "2"],
              HVPS_STALL_CHECK_TIME_SECONDS=3)
    job.assert_exact()
    assert job.sizes() == [3, 2, 2, 2], job.output()
    assert "(rank 1) did not report the failed collective" in job.stderr, job.output()
    assert "127.0.0.1:0 (rank 1) was killed by signal 9; blacklisting host 127.0.0.1" in job.stderr, job.output()


def test_fault_tolerance_without_scaling(tmp_path):
    """-H fixed, no discovery script: a failed worker's host is dropped and the job goes on."""
    job = Job(tmp_path, "", {"1": {"fail": [2], "how": "exit"}},
              ["-H", f"localhost:1,127.0.0.1:1,{HOST}:1", "--min-np", "2"], discovery=False)
    job.assert_exact()
    assert job.sizes() == [3, 2, 2, 2], job.output()


def test_all_ranks_failing(tmp_path):
    job = Job(tmp_path, THREE_HOSTS, {"1": {"fail": [0, 1, 2], "how": "exit", "round": 1}},
              ["-np", "3", "--min-np", "1"])
    assert job.rc != 0, job.output()
    assert "every host is blacklisted" in job.stderr, job.output()


def test_all_hosts_blacklisted(tmp_path):
    """Failures on one host, then on the other: nothing is left to run on."""
    job = Job(tmp_path, "localhost:1\n127.0.0.1:1", {"1": {"fail": [1]}, "2": {"fail": [0]}},
              ["-np", "2", "--min-np", "1"])
    assert job.rc != 0, job.output()
    assert job.sizes()[:2] == [2, 1], job.output()
    assert "every host is blacklisted (127.0.0.1, localhost)" in job.stderr, job.output()


def test_min_hosts_timeout(tmp_path):
    job = Job(tmp_path, "localhost:1\n127.0.0.1:1", {"1": {"fail": [1], "how": "kill"}},
              ["-np", "2", "--min-np", "2", "--elastic-timeout", "2"])
    assert job.rc != 0, job.output()
    assert "fewer than --min-np 2 (--elastic-timeout 2)" in job.stderr, job.output()


@pytest.mark.parametrize("limit, passes", [(1, False), (2, True)])
def test_reset_limit(tmp_path, limit, passes):
    """Two failures are two resets: --reset-limit 1 fails the job, 2 lets it finish."""
    job = Job(tmp_path, THREE_HOSTS, {"1": {"fail": [1]}, "2": {"fail": [1]}},
              ["-np", "3", "--min-np", "1", "--reset-limit", str(limit)])
    if passes:
        job.assert_exact()
    else:
        assert job.rc != 0, job.output()
        assert "more than --reset-limit 1" in job.stderr, job.output()


# -- a stranger who reaches the rendezvous store (issue 38) -------------------------------------------------

TWO_HOSTS = "localhost:1\n127.0.0.1:1"


@pytest.mark.parametrize("ranks", [2, 3])
def test_forged_notices_failure_reports_and_a_replayed_round_change_nothing(tmp_path, ranks):
    """A stranger who reaches the rendezvous store writes, every 10 ms from epoch 1 on, garbage under
    elastic/notice (the job used to reset 365 times in 150 s, training nothing) and under every
    elastic/failed/N/<worker> key (the driver died with a traceback on the first one), and replays
    membership 1's authentic elastic/round (rank 0 used to wait forever for the next membership), while the
    last rank is killed: the survivors go on in membership 2, every step once, and nothing else resets."""
    job = Job(tmp_path, TWO_HOSTS if ranks == 2 else THREE_HOSTS,
              {"1": {"forge": ["notice", "failed", "round"], "fail": [ranks - 1], "how": "kill"}},
              ["-np", str(ranks), "--min-np", "1"], timeout=240)
    assert (tmp_path / "out" / "forging").exists(), "the stranger never got to write:\n" + job.output()
    job.assert_exact()
    assert job.sizes() == [ranks] + [ranks - 1] * 3, job.output()
    assert {line[4] for lines in job.epochs().values() for line in lines} == {1, 2}, job.output()
    assert "the job ran 2 membership(s)" in job.stderr, job.output()
    assert "Traceback" not in job.stderr, job.output()
    assert "ignored the value under 'elastic/" in job.stderr, job.output()
    assert job.stderr.count("does not carry the job's authentication") <= 3 * ranks, "rate-limited\n" + job.output()


def test_resets_without_a_completed_commit_fail_the_job(tmp_path):
    """Every rank fails a collective every time it starts epoch 1: after --resets-without-commit 3 the job
    fails with the loop's one-line reason (the default is 8; there used to be no bound that tripped)."""
    job = Job(tmp_path, TWO_HOSTS, {"1": {"fail": [0, 1], "how": "hvps_error", "always": True}},
              ["-np", "2", "--resets-without-commit", "3"], timeout=90)
    assert job.rc == 1, job.output()
    last = [line for line in job.stderr.splitlines() if line.startswith("hvpsrun") or "error:" in line][-1]
    assert "gave up after 4 resets in a row with no completed commit" in last, job.output()
    assert "fails a collective on purpose at epoch 1" in last, job.output()


def test_blacklisted_host_resurrected(tmp_path):
    """With a cool-down the failed host comes back, as the newest host (the highest ranks)."""
    job = Job(tmp_path, "localhost:1\n127.0.0.1:1", {"1": {"fail": [0], "how": "kill"}},
              ["-np", "2", "--min-np", "1", "--blacklist-cooldown-range", "1", "2"], EPOCHS=7, EPOCH_SECONDS=1.0)
    job.assert_exact(epochs=7)
    sizes = job.sizes()
    assert sizes[:2] == [2, 1] and sizes[-1] == 2, job.output()
    last = job.epochs()[6]
    assert last[1][3] == "localhost" and last[1][4] == 3, "localhost is back, after 127.0.0.1, in rendezvous 3"


@pytest.mark.parametrize("point", ["backward", "between", "step"])
def test_a_rank_dies_with_gradients_in_flight(tmp_path, point):
    """A rank dies in the middle of a step, twice: at 3 ranks (epoch 1, SIGKILL) and at 2 (epoch 2,
    os._exit). The survivors meet the failure at ``point`` of their own step, with gradients in flight
    (inside backward, between backward and step(), inside step()); the restore leaves their
    DistributedOptimizer ready, and the run finishes bit-exact, each step applied once."""
    schedule = {"1": {"fail": [1], "at": point, "size": 3, "how": "kill"},
                "2": {"fail": [1], "at": point, "size": 2, "how": "exit"}}
    job = Job(tmp_path, THREE_HOSTS, schedule, ["-np", "3", "--min-np", "1"])
    job.assert_exact()
    assert job.sizes() == [3, 2, 1, 1], job.output()
    assert job.stderr.count("a collective failed") == 3, job.output()  # 2 survivors, then 1: each recovers once
    assert "gradients are still being reduced" not in job.stderr, job.output()


def test_a_fully_sharded_model_loses_nothing_when_a_rank_is_killed_and_grows_back(tmp_path):
    """Issue 39 item 5, at stage 3: rank 1 of 3 is killed (SIGKILL) in the middle of epoch 1, between its
    backward and its step, while its model is ``hvd.fully_shard``ed. There is no checkpoint: the two survivors
    rebuild its shard from the neighbour copy their commits keep, re-shard for 2 ranks and go on; at epoch 2 a
    slot is added, and the new worker receives its shard of the 3-rank layout. The run is bit-exact the
    uninterrupted one. The recovery time (detection to the first step after it) is printed."""
    job = Job(tmp_path, THREE_HOSTS, {"1": {"fail": [1], "at": "between", "size": 3, "how": "kill"},
                                      "2": {"hosts": f"localhost:1\n127.0.0.1:1\n{HOST}:2"}},
              ["-np", "3", "--min-np", "2"], SHARDED=3, EPOCHS=3)
    job.assert_exact(epochs=3)
    assert job.sizes() == [3, 2, 3], job.output()
    assert job.stderr.count("a collective failed") == 2, job.output()  # each survivor recovers once
    recoveries = [json.loads(line.split(">:", 1)[-1]) for line in job.stdout.splitlines() if "recovery_seconds" in line]
    assert sorted((r["rank"], r["size"]) for r in recoveries) == [(0, 2), (1, 2)], job.output()
    print(f"recovery (detection to the first step after it): {max(r['recovery_seconds'] for r in recoveries)} s")
    assert not list((tmp_path / "out").glob("*.h5")), "no checkpoint was written, so none was read"


# -- Horovod's reported bugs --------------------------------------------------------------------------

def test_graceful_leave_below_min_np_then_a_host_comes(tmp_path):
    """Horovod issue 3494: a host leaves gracefully and the survivors drop below --min-np; Horovod
    deadlocks (the survivors skip the sync that the new worker waits in). hvps waits for hosts, then
    goes on with the new worker, every rank syncing."""
    def add_host_when_short(job, line):
        if "below --min-np 2; waiting" in line:
            job.hosts_file.write_text(f"127.0.0.1:1\n{HOST}:1\n")

    job = Job(tmp_path, "localhost:1\n127.0.0.1:1", {"1": {"hosts": "127.0.0.1:1"}}, ["-np", "2", "--min-np", "2"],
              on_stderr=add_host_when_short)
    job.assert_exact()
    assert job.sizes() == [2, 2, 2, 2], job.output()
    assert job.epochs()[1] == [(0, 2, 1, "127.0.0.1", 2), (1, 2, 1, HOST, 2)], job.output()


def test_worker_exiting_with_status_0_midway(tmp_path):
    """Horovod issue 3852: a worker deleted midway exits with status 0, and Horovod's driver counts it
    a success and ends the job early. hvps's survivors finish every epoch without it."""
    job = Job(tmp_path, THREE_HOSTS, {"1": {"fail": [2], "how": "leave"}}, ["-np", "3", "--min-np", "2"])
    job.assert_exact()
    assert job.sizes() == [3, 2, 2, 2], job.output()
    assert "finished while the others still train" in job.stderr, job.output()


# -- Keras ------------------------------------------------------------------------------------------------

def test_keras_fit_with_a_rank_killed_midway_reaches_the_static_accuracy(tmp_path):
    """Horovod's elastic Keras pattern (KerasState, its three callbacks, model.fit inside
    hvd.elastic.run): rank 1 of 3 is killed in the middle of epoch 2; the two survivors finish, and
    the model is as accurate as the same job's without the kill. Again with a sharded optimizer (issue 39
    item 6): the survivors rebuild the lost shard of the momentum, re-shard for 2 ranks, and ``model.fit``
    traces its step again (the step traced at 3 ranks holds the old shards)."""
    pytest.importorskip("tensorflow", reason="the tensorflow extra is not installed")

    def fit(name, **env):
        (tmp_path / name).mkdir()
        job = Job(tmp_path / name, THREE_HOSTS, flags=["-np", "3", "--min-np", "2"], script=KERAS_FIT,
                  timeout=240, **env)
        assert job.rc == 0, job.output()
        (report,) = [json.loads(line.split(">:", 1)[1]) for line in job.stdout.splitlines()
                     if '"accuracy"' in line]
        return report

    static = fit("static")
    killed = fit("killed", VICTIM=1, KILL_AT="2,5")
    sharded = fit("sharded", VICTIM=1, KILL_AT="2,5", SHARD=1)
    for report in (static, killed, sharded):
        assert report["epoch"] == 5, report  # every epoch counted once across the reset
    assert static["sizes"] == [3] and killed["sizes"] == sharded["sizes"] == [3, 2], (static, killed, sharded)
    assert static["accuracy"] >= 0.9, static
    assert min(killed["accuracy"], sharded["accuracy"]) >= static["accuracy"] - 0.03, (static, killed, sharded)


def test_keras_loop_with_a_rank_killed_inside_a_step_is_bit_exact(tmp_path):
    """A Keras custom loop (a tf.function step, the Keras DistributedOptimizer, TensorFlowKerasState) at
    2 ranks (TensorFlow's import is what costs here): rank 1 dies inside the step; the survivor's
    apply has both gradient buckets in flight and fails on the first. The restore leaves no bucket of
    the interrupted step registered, and the final weights are bit-exact the uninterrupted run's."""
    pytest.importorskip("tensorflow", reason="the tensorflow extra is not installed")
    job = Job(tmp_path, "localhost:1\n127.0.0.1:1", flags=["-np", "2", "--min-np", "1"], script=KERAS_TRAIN,
              timeout=240, VICTIM=1, KILL_AT=1, KILL_SIZE=2, HVPS_TF_BUCKET_BYTES=0, TF_CPP_MIN_LOG_LEVEL=2)
    assert job.rc == 0, job.output()
    final = json.loads((job.dir / "out" / "final.json").read_text())
    reference = json.loads(json.dumps(_inner_job(KERAS_TRAIN).reference()))
    assert final == reference, f"final weights differ from the uninterrupted run\n{job.output()}"
    assert job.sizes() == [2, 1, 1, 1], job.output()
    assert job.stderr.count("a collective failed") == 1, job.output()  # the survivor recovers once
    (restored,) = [json.loads(line.split(">:", 1)[1]) for line in job.stdout.splitlines()
                   if '"restored"' in line]
    assert restored == {"restored": 0, "buckets_before": 1, "buckets_after": 0}, job.output()


# -- bad input ------------------------------------------------------------------------------------------

def test_failing_discovery_script_fails_the_job(tmp_path):
    script = tmp_path / "broken.sh"
    script.write_text("#!/bin/sh\necho 'no inventory here' >&2\nexit 3\n")
    script.chmod(0o755)
    done = subprocess.run([sys.executable, "-m", "hvps.runner.launch", "-np", "1", "--host-discovery-script",
                           str(script), "--discovery-interval", "0.1", sys.executable, TRAIN], capture_output=True,
                          text=True, env=_env(OUT_DIR=tmp_path), timeout=60, cwd=str(REPO_ROOT))
    assert done.returncode != 0
    assert "failed 3 times in a row; the last time it exited with status 3: no inventory here" in done.stderr


@pytest.mark.parametrize("flags, message", [
    (["--min-np", "3", "--max-np", "2"], "--min-np 3 is greater than --max-np 2"),
    (["-H", "localhost:2", "--min-np", "3"], "--min-np 3 is greater than the 2 slots -H/--hostfile offers"),
    (["--min-np", "2"], "elastic mode needs hosts: give --host-discovery-script"),
    (["--host-discovery-script", "/nonexistent/hosts.sh"], "not an executable file"),
    (["-H", "localhost:2", "--min-np", "1", "--max-restarts", "2"], "drop --max-restarts"),
    (["-H", "localhost:2", "--min-np", "1", "--backend", "mpi"], "--backend mpi needs MPI"),
])
def test_bad_elastic_flags(flags, message):
    with pytest.raises(LaunchError, match=message.replace("(", r"\(").replace(")", r"\)")):
        prepare(parse_args(flags + [sys.executable, TRAIN]), {})


def test_bad_cooldown_range():
    with pytest.raises(LaunchError, match="give MIN > 0 and MAX >= MIN"):
        parse_args(["--blacklist-cooldown-range", "10", "5", "-H", "localhost:1", "true"])


# -- the driver's parts ----------------------------------------------------------------------------------

def test_discovery_output_parsing():
    assert parse_discovery("# hosts\nhost-a:2\nhost-b\n\n[::1]:3\n", slots_per_host=4) == [
        Host("host-a", 2), Host("host-b", 4), Host("::1", 3)]
    assert parse_discovery("") == []
    for garbage, why in (("host-a:two", "not 'host' or 'host:slots'"), ("a:1\na:2", "lists a host twice")):
        with pytest.raises(DiscoveryError, match=why):
            parse_discovery(garbage)


def test_discovery_retries_then_fails(tmp_path):
    hanging = tmp_path / "hang.sh"
    hanging.write_text("#!/bin/sh\nsleep 30\n")
    hanging.chmod(0o755)
    discovery = Discovery(DiscoveryScript(str(hanging), timeout=0.2), attempts=2)
    assert discovery.find() is None  # the first failure is retried
    with pytest.raises(LaunchError, match="failed 2 times in a row; the last time it did not finish within 0.2 s"):
        discovery.find()


def test_a_discovery_script_printing_a_huge_line_is_a_clear_error(tmp_path):
    """Issue 38: a 400 MB line made hvpsrun 4.8 GiB resident and ended in a raw traceback. Its output is now
    bounded (1 MiB, then the script is ended) and so is a line ('host:slots')."""
    import time

    flood = tmp_path / "flood.sh"
    flood.write_text("#!/bin/sh\nhead -c 400000000 /dev/zero | tr '\\0' a\n")
    flood.chmod(0o755)
    long_line = tmp_path / "long.sh"
    long_line.write_text("#!/bin/sh\nprintf 'a%.0s' $(seq 1 5000); echo\n")
    long_line.chmod(0o755)
    began = time.monotonic()
    with pytest.raises(DiscoveryError, match="printed more than 1048576 bytes"):
        DiscoveryScript(str(flood)).find()
    with pytest.raises(DiscoveryError, match="line 1 is 5000 characters long"):
        DiscoveryScript(str(long_line)).find()
    assert time.monotonic() - began < 10


def test_blacklist_cooldown_doubles_up_to_max():
    now = [0.0]
    blacklist = Blacklist((10.0, 35.0), clock=lambda: now[0], rand=lambda: 0.5)  # no jitter at 0.5
    assert [blacklist.add("a") for _ in range(4)] == [10.0, 20.0, 35.0, 35.0]
    assert blacklist.blocked("a") and not blacklist.permanent("a")
    now[0] = 36.0
    assert not blacklist.blocked("a")
    forever = Blacklist()
    assert forever.add("b") == float("inf") and forever.permanent("b")


def test_assign_keeps_old_hosts_first_and_caps_at_max_np():
    slots = assign([Host("old", 2), Host("new", 2)], finished={"old:1"}, max_np=2)
    assert {w: (s.rank, s.local_rank, s.local_size, s.cross_rank, s.cross_size) for w, s in slots.items()} == {
        "old:0": (0, 0, 1, 0, 2), "new:0": (1, 0, 1, 1, 2)}
    assert all(s.size == 2 for s in slots.values())
    assert assign([], set(), None) == {}


def test_a_stranger_cannot_forge_a_membership_or_a_notice():
    """The rendezvous store has no authentication; the driver's values are sealed with the job's secret."""
    import torch.distributed as dist

    from hvps.control import membership
    from hvps.core.errors import HvpsError

    store, secret = dist.HashStore(), b"job secret of 32 bytes, really.."
    slot = membership.Slot(0, 1, "localhost", 0, 1, 0, 1)
    membership.publish_round(store, secret, 1, {"localhost:0": slot})
    assert membership.latest_round(store, secret) == 1
    assert membership.round_slots(store, secret, 1) == {"localhost:0": slot}
    stale = store.get(membership.ROUND_KEY)
    membership.publish_round(store, b"a stranger's guess of the secret", 2, {"localhost:0": slot})
    assert membership.latest_round(store, secret) == 1  # a forged round is no round
    with pytest.raises(HvpsError, match="'elastic/round/2' .* does not carry the job's authentication"):
        membership.round_slots(store, secret, 2)
    membership.publish_round(store, secret, 2, {"localhost:0": slot})
    store.set(membership.ROUND_KEY, stale)  # an authentic but old value, replayed
    assert membership.latest_round(store, secret) == 2 and membership.latest_round(store, secret, 1) == 2
    store.set(membership.NOTICE_KEY, b'{"round": 9, "timestamp": 1, "kind": 3}')
    assert membership.notice(store, secret) is None
    membership.publish_notice(store, secret, 3, 5.0, 2)
    assert membership.notice(store, secret) == {"round": 3, "timestamp": 5.0, "kind": 2}
    store.set(membership.failed_key(2, "localhost:0"), b"forged")
    assert membership.failure_reports(store, secret, 2, ["localhost:0"]) == {}
    membership.report_failure(store, secret, 2, "localhost:0", "allreduce failed")
    assert membership.failure_reports(store, secret, 2, ["localhost:0"]) == {"localhost:0": "allreduce failed"}
