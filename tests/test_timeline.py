"""HVPS_TIMELINE writes a Chrome trace of every collective (one process, MPI singleton)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import numpy as np, hvps
hvps.init()
hvps.allreduce(np.arange(5.0), name="weights")
hvps.broadcast(np.arange(3), 0, name="step")
hvps.shutdown()
"""


def test_timeline_records_negotiation_and_operation(tmp_path):
    trace = tmp_path / "timeline.json"
    env = dict(os.environ, HVPS_TIMELINE=str(trace), PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    events = json.loads(trace.read_text())
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M"}
    spans = [(rows[e["tid"]], e["name"]) for e in events if e.get("ph") == "X"]
    assert ("allreduce.weights", "NEGOTIATE") in spans
    assert ("allreduce.weights", "ALLREDUCE") in spans
    assert ("broadcast.step", "BROADCAST") in spans
    assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")
