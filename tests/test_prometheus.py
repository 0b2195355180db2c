"""The Grafana dashboard and the Prometheus configuration in jobs/monitoring/.

Grafana is not packaged in our registries, so the dashboard's JSON is checked for the
structure Grafana needs (schemaVersion, template variables, datasource uids, unique panel ids,
grid positions, targets with expressions), and every PromQL query in it runs against a REAL
Prometheus (Debian's ``prometheus`` package) that scrapes a real 2-rank training job under
mpirun. Queries of GPU metrics can only return data where NVML sees a GPU: without one they
must still be valid (status success) and empty, and they must be exactly the GPU queries.
"""

import json
import math
import re
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest
from conftest import REPO_ROOT, run_mpi
from test_metrics import free_ports

MONITORING = REPO_ROOT / "jobs" / "monitoring"
DASHBOARD = MONITORING / "grafana-dashboard.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
NEEDS_PROMETHEUS = "needs Prometheus: apt-get install prometheus (Debian's package; tested with 2.42)"
#: Grafana's own variables, substituted here as Grafana would with a 1 s scrape interval
GRAFANA_BUILTINS = {"__rate_interval": "4s", "__interval": "1s", "__range": "1m"}


def dashboard():
    return json.loads(DASHBOARD.read_text())


def variables(dash):
    return {v["name"]: v for v in dash["templating"]["list"]}


def targets(dash):
    """(panel title, expr) of every query of every panel, rows included."""
    out = []
    for panel in dash["panels"]:
        for inner in [panel, *panel.get("panels", [])]:
            out.extend((inner["title"], t["expr"]) for t in inner.get("targets", []))
    return out


def substitute(expr, values):
    def one(match):
        name = match.group(1) or match.group(2)
        return values[name]
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def test_dashboard_structure():
    dash = dashboard()
    assert isinstance(dash["schemaVersion"], int) and dash["schemaVersion"] >= 36
    assert dash["uid"] and dash["title"]
    declared = variables(dash)
    assert declared["datasource"]["type"] == "datasource" and declared["datasource"]["query"] == "prometheus"
    for name in ("job", "host", "rank"):
        var = declared[name]
        assert var["type"] == "query" and var["datasource"]["uid"] == "${datasource}"
        assert re.fullmatch(r"label_values\(hvps_info(\{.*\})?, " + name + r"\)", var["query"]["query"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells = set()
    for panel in dash["panels"]:
        pos = panel["gridPos"]
        assert all(isinstance(pos[k], int) for k in ("h", "w", "x", "y"))
        assert pos["w"] > 0 and pos["h"] > 0 and 0 <= pos["x"] and pos["x"] + pos["w"] <= 24
        mine = {(x, y) for x in range(pos["x"], pos["x"] + pos["w"]) for y in range(pos["y"], pos["y"] + pos["h"])}
        assert not cells & mine, f"panel {panel['title']!r} overlaps another"
        cells |= mine
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs))
        for target in panel["targets"]:
            assert target["expr"].strip() and target["datasource"]["uid"] == "${datasource}"
            used = set(re.findall(r"\$\{?(\w+)", target["expr"]))
            assert used <= set(declared) | set(GRAFANA_BUILTINS), f"undeclared variables {used - set(declared)}"
    titles = " | ".join(p["title"].lower() for p in dash["panels"])
    for wanted in ("step time", "samples/s", "communication share", "bytes/s by op", "stalls", "gpu utilisation",
                   "gpu power", "checkpoint"):
        assert wanted in titles, f"no {wanted!r} panel"


@pytest.mark.skipif(PROMTOOL is None, reason=NEEDS_PROMETHEUS)
def test_shipped_prometheus_config_is_valid():
    out = subprocess.run([PROMTOOL, "check", "config", str(MONITORING / "prometheus.yml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def _api(base, path, **params):
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params, doseq=True)}"
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return json.loads(response.read())
    except urllib.error.HTTPError as exc:  # 400: a query Prometheus cannot parse
        return json.loads(exc.read())


def _start_prometheus(tmp_path, job, targets_):
    web = free_ports()
    config = tmp_path / "prometheus.yml"
    # JSON is YAML: no YAML library needed.
    config.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": targets_}]}]}))
    log = open(tmp_path / "prometheus.log", "w")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
                             f"--web.listen-address=127.0.0.1:{web}", "--log.level=warn"],
                            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{web}"
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
        try:
            with urllib.request.urlopen(f"{base}/-/ready", timeout=2) as response:
                if response.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.2)
    proc.kill()
    pytest.fail("Prometheus did not become ready in 30 s:\n" + (tmp_path / "prometheus.log").read_text())


def _has_finite(result):
    return any(math.isfinite(float(v)) for series in result for _, v in series.get("values", []))


@pytest.mark.timeout(240)
@pytest.mark.skipif(PROMETHEUS is None, reason=NEEDS_PROMETHEUS)
def test_every_dashboard_query_returns_data_from_a_real_job(tmp_path):
    from hvps.metrics.nvml import close_nvml, open_nvml

    job = re.search(r"job_name:\s*(\S+)", (MONITORING / "prometheus.yml").read_text()).group(1)
    port = free_ports(2)
    ranks = [f"127.0.0.1:{port}", f"127.0.0.1:{port + 1}"]  # local ranks 0 and 1: port + local rank
    prometheus, base = _start_prometheus(tmp_path, job, ranks)
    try:
        start = time.time()
        shared = tmp_path / "shared"
        shared.mkdir()
        result = run_mpi("mpi_metrics_job.py", 2, timeout=150, env={
            "HVPS_METRICS_PORT": str(port), "HVPS_STALL_CHECK_TIME_SECONDS": "3",
            "HVPS_TEST_METRICS_SECONDS": "7", "HVPS_TEST_SHARED_DIR": str(shared)})
        result.assert_all_passed()
        end = time.time()
        window = {"start": f"{start:.3f}", "end": f"{end:.3f}", "step": "1"}

        # Both ranks were scraped, each on its port + local rank, with its rank label.
        info = _api(base, "query_range", query=f'hvps_info{{job="{job}"}}', **window)["data"]["result"]
        assert {(s["metric"]["instance"], s["metric"]["rank"]) for s in info} == {(ranks[0], "0"), (ranks[1], "1")}
        stalls = _api(base, "query_range", query=f'hvps_stalls_total{{job="{job}",rank="0"}}', **window)
        assert max(float(v) for _, v in stalls["data"]["result"][0]["values"]) == 1

        # The template variables' label_values() queries, through the label values API.
        hostname = socket.gethostname()
        values = {"job": job, "host": hostname, "rank": ".*", "datasource": "prometheus", **GRAFANA_BUILTINS}
        declared = variables(dashboard())
        expected = {"job": [job], "host": [hostname], "rank": ["0", "1"]}
        for name in ("job", "host", "rank"):
            metric, label = re.fullmatch(r"label_values\((.+), (\w+)\)", declared[name]["query"]["query"]).groups()
            answer = _api(base, f"label/{label}/values", **{"match[]": substitute(metric, values)},
                          start=window["start"], end=window["end"])
            assert answer["status"] == "success" and sorted(answer["data"]) == expected[name], (name, answer)

        pynvml, no_gpu = open_nvml()
        close_nvml(pynvml)
        empty, broken = [], []
        for title, expr in targets(dashboard()):
            query = substitute(expr, values)
            answer = _api(base, "query_range", query=query, **window)
            if answer.get("status") != "success":
                broken.append(f"{title}: {query}: {answer.get('error')}")
            elif not _has_finite(answer["data"]["result"]):
                empty.append((title, query))
        assert not broken, "queries Prometheus rejects:\n" + "\n".join(broken)
        gpu = [(title, query) for title, query in empty if "hvps_gpu_" in query]
        assert empty == gpu, "queries without data:\n" + "\n".join(f"{t}: {q}" for t, q in empty if (t, q) not in gpu)
        if pynvml is None:  # no GPU here: every GPU query is valid and empty
            assert gpu == [(t, substitute(e, values)) for t, e in targets(dashboard()) if "hvps_gpu_" in e], no_gpu
        else:
            assert not gpu, f"GPU queries without data although NVML works: {gpu}"
    finally:
        prometheus.terminate()
        try:
            prometheus.wait(timeout=15)
        except subprocess.TimeoutExpired:
            prometheus.kill()
