"""HVPS_TIMELINE (or HOROVOD_TIMELINE) writes a Chrome trace of every collective in Horovod's phases, readable while
the job runs and valid JSON once closed (one process, MPI singleton)."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCRIPT = """
import json, sys, numpy as np, hvps
hvps.init()
hvps.allreduce(np.arange(5.0), name="weights")
text = open(sys.argv[1]).read()  # mid-run: what was executed is already in the file
assert "NEGOTIATE_ALLREDUCE" in text and "CYCLE_START" in text, text
json.loads(text.rstrip().rstrip(",") + "]")  # an unterminated array, as Chrome reads it
hvps.broadcast(np.arange(3), 0, name="step")
hvps.stop_timeline()
hvps.allreduce(np.arange(5.0), name="after")
hvps.shutdown()
"""


def test_timeline_records_negotiation_and_operation(tmp_path):
    trace = tmp_path / "timeline.json"
    env = dict(os.environ, HOROVOD_TIMELINE=str(trace), HVPS_TIMELINE_MARK_CYCLES="1", PYTHONPATH=str(REPO))
    env.pop("HVPS_TIMELINE", None)
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(trace)], env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    events = json.loads(trace.read_text())
    rows = {e["tid"]: e["args"]["name"] for e in events if e.get("ph") == "M" and "tid" in e}
    spans = [(rows[e["tid"]], e["name"]) for e in events if e.get("ph") == "X"]
    assert ("allreduce.weights", "NEGOTIATE_ALLREDUCE") in spans
    assert ("allreduce.weights", "ALLREDUCE") in spans
    assert ("broadcast.step", "BROADCAST") in spans
    assert "allreduce.after" not in rows.values()  # stop_timeline() closed it
    assert any(e.get("name") == "CYCLE_START" and e.get("ph") == "i" for e in events)
    assert all(e["dur"] >= 0 for e in events if e.get("ph") == "X")
