"""hvps.metrics.energy: RAPL on fake powercap trees (packages summed, subdomains and psys not counted
twice, wraparound), NVML where there is no GPU, combining ranks, and the ResNet-50 harness's
JSON fields."""

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT

from hvps.metrics import energy
from hvps.metrics.energy import EnergyMeter

MAX_RANGE = 262143328850


def domain(root, name, label, energy_uj, max_range=MAX_RANGE):
    path = root / name
    path.mkdir(parents=True)
    (path / "name").write_text(label + "\n")
    (path / "energy_uj").write_text(f"{energy_uj}\n")
    (path / "max_energy_range_uj").write_text(f"{max_range}\n")
    return path


def set_energy(path, energy_uj):
    (path / "energy_uj").write_text(f"{energy_uj}\n")


@pytest.mark.unit
def test_rapl_sums_packages_only(tmp_path):
    """Two packages count; their core/dram subdomains, psys and the MMIO copy do not."""
    pkg0 = domain(tmp_path, "intel-rapl:0", "package-0", 1_000_000)
    pkg1 = domain(tmp_path, "intel-rapl:1", "package-1", 5_000_000)
    core = domain(tmp_path, "intel-rapl:0:0", "core", 100)
    psys = domain(tmp_path, "intel-rapl:2", "psys", 0)
    mmio = domain(tmp_path, "intel-rapl-mmio:0", "package-0", 0)
    (tmp_path / "intel-rapl").mkdir()  # the control type's own directory has no counter
    meter = EnergyMeter(powercap_root=str(tmp_path)).start()
    set_energy(pkg0, 31_000_000)  # +30 J
    set_energy(pkg1, 17_000_000)  # +12 J
    for other in (core, psys, mmio):
        set_energy(other, 999_000_000)
    reading = meter.stop(images=21)
    assert reading["joules"] == pytest.approx(42.0)
    assert reading["joules_per_image"] == pytest.approx(2.0)
    assert reading["watts"] == pytest.approx(42.0 / reading["seconds"])
    assert reading["source"] == "rapl:package-0+package-1" and reading["reason"] is None


@pytest.mark.unit
def test_rapl_wraparound(tmp_path):
    pkg = domain(tmp_path, "intel-rapl:0", "package-0", MAX_RANGE - 2_000_000)
    meter = EnergyMeter(powercap_root=str(tmp_path)).start()
    set_energy(pkg, 3_000_000)  # wrapped: 2 J to the top, then 3 J
    assert meter.stop()["joules"] == pytest.approx(5.0)


@pytest.mark.unit
def test_rapl_psys_only_when_no_package(tmp_path):
    psys = domain(tmp_path, "intel-rapl:0", "psys", 0)
    meter = EnergyMeter(powercap_root=str(tmp_path)).start()
    set_energy(psys, 7_500_000)
    reading = meter.stop(images=3)
    assert reading["joules"] == pytest.approx(7.5) and reading["source"] == "rapl:psys"


@pytest.mark.unit
def test_no_powercap_gives_none_and_the_reason(tmp_path):
    reading = EnergyMeter(powercap_root=str(tmp_path / "missing")).start().stop(images=4)
    assert reading["joules"] is None and reading["watts"] is None and reading["joules_per_image"] is None
    assert str(tmp_path / "missing") in reading["reason"]
    empty = EnergyMeter(powercap_root=str(tmp_path)).start().stop()
    assert "no intel-rapl:N package domains" in empty["reason"]


@pytest.mark.unit
def test_unreadable_counter_gives_the_reason(tmp_path):
    pkg = domain(tmp_path, "intel-rapl:0", "package-0", 0)
    if os.geteuid() == 0:  # root reads any file: make the counter unreadable another way
        (pkg / "energy_uj").unlink()
        (pkg / "energy_uj").mkdir()
        expected = "cannot read"
    else:
        (pkg / "energy_uj").chmod(0)
        expected = "root only since Linux 5.10"
    reading = EnergyMeter(powercap_root=str(tmp_path)).start().stop()
    assert reading["joules"] is None and expected in reading["reason"]


@pytest.mark.unit
def test_gpu_meter_without_a_gpu_says_why():
    from hvps.metrics.nvml import close_nvml, open_nvml

    pynvml, reason = open_nvml()
    close_nvml(pynvml)
    if pynvml is not None:
        pytest.skip("NVML works here: the no-GPU path cannot be seen")
    reading = EnergyMeter(cuda_index=0).start().stop(images=2)
    assert reading["joules"] is None and reading["reason"] == reason


@pytest.mark.unit
def test_combine_adds_gpus_and_hosts_and_skips_shared_counters():
    gpu = [{"joules": 10.0, "seconds": 2.0, "images": None, "source": "nvml", "reason": None},
           {"joules": 14.0, "seconds": 3.0, "images": None, "source": "nvml", "reason": None}]
    both = energy.combine(gpu, images=12)
    assert both["joules"] == 24.0 and both["watts"] == 8.0 and both["joules_per_image"] == 2.0
    shared = EnergyMeter(reads_host=False).start().stop()
    assert shared["counted_elsewhere"]
    assert energy.combine([gpu[0], shared], images=5)["joules"] == 10.0
    missing = {"joules": None, "seconds": 1.0, "images": None, "source": None, "reason": "why"}
    assert energy.combine([gpu[0], missing], images=5)["reason"] == "why"
    pooled = energy.pool([both, energy.combine([gpu[1]], images=6)])
    assert pooled["joules"] == 38.0 and pooled["images"] == 18 and pooled["seconds"] == 6.0


def _rapl_readable():
    domains, _ = energy.rapl_domains()
    return bool(domains) and energy.read_rapl(domains)[0] is not None


@pytest.mark.timeout(120)
def test_resnet50_harness_json_has_energy_fields(tmp_path):
    out = tmp_path / "resnet.json"
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMPI_MCA_mpi_yield_when_idle="1")
    env.pop("HVPS_METRICS_PORT", None)
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "pytorch_synthetic_benchmark.py"),
                           "--batch-size", "2", "--image-size", "32", "--num-warmup-batches", "1",
                           "--num-batches-per-iter", "1", "--num-iters", "2", "--json", str(out)],
                          env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("joules_per_image", "avg_watts", "energy_joules", "energy_source", "energy_reason"):
        assert key in result
    assert result["distributed"]["energy"]["images"] == 4
    if _rapl_readable():
        assert result["joules_per_image"] > 0 and result["avg_watts"] > 0 and result["energy_reason"] is None
        assert result["energy_source"].startswith("rapl:")
    else:
        assert result["joules_per_image"] is None and result["avg_watts"] is None
        assert result["energy_source"] is None and result["energy_reason"]
        assert "Energy: n/a" in proc.stdout
