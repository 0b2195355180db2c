"""Bounded fuzz runs over checkpoint reading: mutated real checkpoints
(tests/fuzz/fuzz_checkpoint.py) and mutated store shards and store manifests
(tests/fuzz/fuzz_store.py), 0 crashes. HVPS_FUZZ_SECONDS sets the budget of the first (30 s by
default), the store gets a quarter of it; atheris when installed, random byte mutation otherwise.

The fuzzer reads metadata in its own process, so libhdf5's own failures on a corrupt file
(hangs, memory blow-ups, segfaults) show up there as timeouts, OOMs and crashes. Those are
what load() runs that inspection in a helper process for: every such input is replayed
through the real path and must end in a CheckpointError. A Python exception other than a
CheckpointError fails the run either way (in the replay, as a "crash" outcome)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from ckpt_forge import make_versions

from hvps.checkpoint.manager import CheckpointManager

FUZZER = Path(__file__).parent / "fuzz" / "fuzz_checkpoint.py"
STORE_FUZZER = Path(__file__).parent / "fuzz" / "fuzz_store.py"
SECONDS = float(os.environ.get("HVPS_FUZZ_SECONDS", "30"))
STORE_SECONDS = SECONDS / 4
REPLAY_DEADLINE = 2  # HVPS_CHECKPOINT_INSPECT_TIMEOUT for the replay of hangs
REPLAY_MAX = 3  # timeout and OOM artifacts replayed (each costs up to the deadline); crashes: all


def _corpus(tmp_path: Path) -> Path:
    """Seeds: real checkpoints, plain and lzf-compressed, with every section kind."""
    make_versions(tmp_path / "plain", epochs=(1,))
    mgr = CheckpointManager(tmp_path / "lzf", compress=True)
    mgr.save(1, model={"w": np.arange(300, dtype=np.float32)}, optimizer={"state": {"0": {"m": np.ones(5)}}},
             extra={"t": (1, 2)})
    mgr.wait_for_retention()
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, f in enumerate(sorted(tmp_path.glob("*/ckpt-epoch-*.h5"))):
        (corpus / f"seed{i}").write_bytes(f.read_bytes())
    return corpus


@pytest.mark.timeout(SECONDS + 180)
def test_fuzz_checkpoint_reading(tmp_path):
    _fuzz(FUZZER, _corpus(tmp_path), tmp_path, SECONDS, {})


@pytest.mark.timeout(STORE_SECONDS + 180)
def test_fuzz_store_reading(tmp_path):
    """Shards (HDF5) and store manifests (JSON) of a real store version, through the checks each
    rank runs before a version is loaded."""
    corpus, version = tmp_path / "corpus", tmp_path / "version"
    spec = importlib.util.spec_from_file_location("fuzz_store", STORE_FUZZER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.seeds(str(corpus), str(version))
    _fuzz(STORE_FUZZER, corpus, tmp_path, STORE_SECONDS, {"FUZZ_STORE_VERSION": str(version)})


def _fuzz(fuzzer: Path, corpus: Path, tmp_path: Path, seconds: float, extra_env: dict) -> None:
    wrapper = tmp_path / "fuzz.sh"  # libFuzzer's -fork mode executes argv[0] itself
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{fuzzer}" "$@"\n')
    wrapper.chmod(0o755)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parent.parent), HVPS_FUZZ_SELF=str(wrapper), **extra_env)
    if importlib.util.find_spec("atheris") is not None:
        max_len = max(f.stat().st_size for f in corpus.iterdir()) + 256
        cmd = [sys.executable, str(fuzzer), str(corpus), f"-max_total_time={seconds:g}", f"-max_len={max_len}",
               "-rss_limit_mb=2048", "-timeout=5", "-fork=1", "-ignore_timeouts=1", "-ignore_ooms=1",
               "-ignore_crashes=1", f"-artifact_prefix={tmp_path}/"]
    else:
        cmd = [sys.executable, str(fuzzer), "--random", str(corpus), f"{seconds:g}"]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 100)
    out = proc.stdout + proc.stderr
    runs = re.findall(r"#(\d+): cov: .* oom/timeout/crash: (\d+)/(\d+)/(\d+)", out) or \
        re.findall(r"fuzz: (\d+) inputs, \d+ crashes", out)
    print(f"fuzz: {runs[-1] if runs else out[-2000:]} (inputs, ooms, timeouts, crashes)")
    assert runs, out[-4000:]
    if len(runs[-1]) == 4:  # libFuzzer: 70/71/77: a timeout/OOM/crash in a child, each left an artifact
        assert proc.returncode in (0, 70, 71, 77), out[-4000:]
        assert "Uncaught Python exception" not in out, out[-4000:]
        crashes = len(list(tmp_path.glob("crash-*")))
        assert crashes >= (runs[-1][3] != "0"), "a crash was counted but left no input to replay"
        _crashes_are_native(fuzzer, tmp_path, env)
    else:
        assert proc.returncode == 0, out[-4000:]
    _replay_through_the_helper(fuzzer, tmp_path, env)


def _crashes_are_native(fuzzer: Path, tmp_path: Path, env: dict) -> None:
    """Each crash input, run alone in a fresh process as the fuzzer ran it, either kills it with
    a signal (libhdf5) or ends normally (the crash needed state from earlier inputs); an
    uncaught Python exception is a bug in hvps."""
    for crash in sorted(tmp_path.glob("crash-*")):
        proc = subprocess.run([sys.executable, str(fuzzer), "--inprocess", str(crash)], env=env,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode <= 0, f"{crash.name}: {proc.stderr[-4000:]}"


def _replay_through_the_helper(fuzzer: Path, tmp_path: Path, env: dict) -> None:
    """Hangs, memory blow-ups and native crashes found in-process end in a CheckpointError
    through the helper process (deadline REPLAY_DEADLINE s, memory cap) that load() uses."""
    found = (sorted(tmp_path.glob("timeout-*"))[:REPLAY_MAX] + sorted(tmp_path.glob("oom-*"))[:REPLAY_MAX]
             + sorted(tmp_path.glob("crash-*")))
    if not found:
        return
    proc = subprocess.run([sys.executable, str(fuzzer), "--replay", str(REPLAY_DEADLINE), *map(str, found)],
                          env=env, capture_output=True, text=True, timeout=len(found) * (REPLAY_DEADLINE + 10))
    lines = re.findall(r"^replay: (\S+) (\w+)", proc.stdout, re.M)
    print(f"replayed through the helper: {lines}")
    assert proc.returncode == 0 and len(lines) == len(found), proc.stdout[-4000:] + proc.stderr[-4000:]
    assert all(outcome in ("error", "ok") for _, outcome in lines), proc.stdout[-4000:]
