"""hvps doctor: every check's verdicts from fake /proc and /sys trees (--root), the report, --apply and
--revert on a fake tree, the refusal of unsafe tunings (real-time priority, a 99 ns scheduler slice), and real
runs on this machine under 1, 2 and 3 ranks."""
from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT, mpirun_argv

from hvps import cli
from hvps.doctor import REGISTRY, Context, Host
from hvps.doctor.apply import apply, revert
from hvps.doctor.checks_container import detect_container
from hvps.doctor.checks_gpu import driver_verdict
from hvps.doctor.checks_network import nccl_matches
from hvps.doctor.gpu import _from_smi
from hvps.doctor.host import FACTS_FILE
from hvps.doctor.report import merge
from hvps.doctor.runner import collect

GiB, MiB = 1 << 30, 1 << 20
CPUFREQ = "sys/devices/system/cpu/cpu{}/cpufreq/"
THP = "sys/kernel/mm/transparent_hugepage/"

HEALTHY_FILES = {
    **{CPUFREQ.format(i) + "scaling_governor": "performance" for i in (0, 1)},
    **{CPUFREQ.format(i) + "scaling_driver": "acpi-cpufreq" for i in (0, 1)},
    **{CPUFREQ.format(i) + "scaling_available_governors": "performance powersave" for i in (0, 1)},
    "sys/devices/system/cpu/smt/control": "on",
    "sys/devices/system/cpu/smt/active": "1",
    "sys/devices/system/node/node0/cpulist": "0-1",
    "proc/self/status": "Name:\tpython\nCpus_allowed_list:\t0-1\n",
    THP + "enabled": "always [madvise] never",
    THP + "defrag": "always defer defer+madvise [madvise] never",
    "proc/sys/vm/swappiness": "10",
    "proc/meminfo": "MemTotal:       16000000 kB\nSwapTotal:       1000000 kB\n",
    "proc/self/cgroup": "0::/\n",
    "sys/fs/cgroup/cpu.max": "max 100000",
    "sys/fs/cgroup/memory.max": "max",
    "proc/sys/kernel/sched_min_granularity_ns": "3000000",
    "proc/sys/kernel/sched_rt_runtime_us": "950000",
    "sys/class/net/eth0/mtu": "9000",
    "sys/class/net/eth0/speed": "100000",
    "sys/class/net/eth0/operstate": "up",
    "sys/class/net/lo/mtu": "65536",
    "etc/os-release": 'NAME="Debian GNU/Linux"\nPRETTY_NAME="Debian GNU/Linux 12 (bookworm)"',
    "proc/sys/kernel/osrelease": "6.1.0-27-amd64",
    "proc/cpuinfo": "processor\t: 0\nflags\t\t: fpu sse2 aes avx2",
}
GPU = {"index": 0, "name": "H200", "persistence": True, "compute_mode": "Default", "ecc": True,
       "retired_pending": False, "remap_pending": False, "sm_clock": 1980, "sm_clock_max": 1980,
       "power_limit_w": 700.0, "power_default_w": 700.0, "throttle": [], "bus_id": "00000000:18:00.0"}
HEALTHY_FACTS = {
    "hostname": "node-a",
    "env": {},
    "rlimit_memlock": [None, None],
    "rlimit_nofile": [1048576, 1048576],
    "statvfs:/dev/shm": {"total": 8 * GiB, "free": 8 * GiB},
    "sched": {"policy": "SCHED_OTHER", "priority": 0, "nice": 0},
    "addresses": {"eth0": "10.0.0.1", "lo": "127.0.0.1"},
    "seal_bytes_per_s": 4e9,
    "software": {"python": "3.11.7", "hvps": "0.1.0", "torch": "2.13.0", "tensorflow": None, "mpi4py": "4.1.2",
                 "mpi": "Open MPI 5.0.11"},
    "gpu": {"source": "nvml", "driver": "570.86.15", "cuda_runtime": "12.8", "nccl": "2.26.2",
            "gpus": [GPU, dict(GPU, index=1, bus_id="00000000:2a:00.0")], "links": [{"a": 0, "b": 1, "link": "NV18"}],
            "reason": None},
}


def make_tree(root: Path, files: dict = None, facts: dict = None) -> Path:
    """HEALTHY_* with ``files`` (path -> text, None deletes) and ``facts`` (key -> value, None deletes) laid over."""
    all_files = dict(HEALTHY_FILES, **(files or {}))
    for rel, text in all_files.items():
        if text is not None:
            (root / rel).parent.mkdir(parents=True, exist_ok=True)
            (root / rel).write_text(text + "\n")
    all_facts = copy.deepcopy(HEALTHY_FACTS)
    all_facts.update(facts or {})
    (root / FACTS_FILE).write_text(json.dumps({k: v for k, v in all_facts.items() if v is not None}))
    return root


def gpus(**changes) -> dict:
    """GPU facts with ``changes`` applied to GPU 1 (``links=``, ``driver=`` etc. to the whole)."""
    facts = copy.deepcopy(HEALTHY_FACTS["gpu"])
    for key in ("links", "driver", "cuda_runtime", "nccl", "gpus"):
        if key in changes:
            facts[key] = changes.pop(key)
    if facts["gpus"]:
        facts["gpus"][-1].update(changes)
    return facts


NO_GPU = {"gpus": [], "links": [], "driver": None, "cuda_runtime": None, "nccl": None,
          "reason": "NVML: NVMLError_LibraryNotFound"}
NO_CPUFREQ = {CPUFREQ.format(i) + f: None for i in (0, 1) for f in
              ("scaling_governor", "scaling_driver", "scaling_available_governors")}
TWO_NODES = {"sys/devices/system/node/node0/cpulist": "0", "sys/devices/system/node/node1/cpulist": "1"}
IB_PORT = "sys/class/infiniband/mlx5_0/ports/1/"

# (check, expected verdict, file changes, fact changes, context)
CASES = [
    ("cpu.governor", "ok", {}, {}, {}),
    ("cpu.governor", "warn", {CPUFREQ.format(1) + "scaling_governor": "schedutil"}, {}, {}),
    ("cpu.governor", "warn", {CPUFREQ.format(0) + "scaling_governor": "powersave",
                              CPUFREQ.format(0) + "scaling_driver": "intel_pstate"}, {}, {}),
    ("cpu.governor", "fail", {CPUFREQ.format(0) + "scaling_governor": "powersave"}, {}, {}),
    ("cpu.governor", "skip", NO_CPUFREQ, {}, {}),
    ("cpu.smt", "ok", {}, {}, {}),
    ("cpu.smt", "warn", {}, {"env": {"OMP_NUM_THREADS": "2"}}, {"ranks_per_node": 2}),
    ("cpu.smt", "skip", {"sys/devices/system/cpu/smt/control": None}, {}, {}),
    ("cpu.numa", "ok", {}, {}, {}),
    ("cpu.numa", "ok", dict(TWO_NODES, **{"proc/self/status": "Cpus_allowed_list:\t1"}), {}, {}),
    ("cpu.numa", "warn", TWO_NODES, {}, {}),
    ("mem.thp", "ok", {}, {}, {}),
    ("mem.thp", "warn", {THP + "enabled": "always madvise [never]"}, {}, {}),
    ("mem.thp", "warn", {THP + "enabled": "[always] madvise never"}, {}, {}),
    ("mem.thp", "fail", {THP + "enabled": "[always] madvise never",
                         THP + "defrag": "[always] defer defer+madvise madvise never"}, {}, {}),
    ("mem.thp", "skip", {THP + "enabled": None, THP + "defrag": None}, {}, {}),
    ("mem.swappiness", "ok", {}, {}, {}),
    ("mem.swappiness", "ok", {"proc/sys/vm/swappiness": "100", "proc/meminfo": "SwapTotal: 0 kB"}, {}, {}),
    ("mem.swappiness", "warn", {"proc/sys/vm/swappiness": "60"}, {}, {}),
    ("mem.swappiness", "fail", {"proc/sys/vm/swappiness": "100"}, {}, {}),
    ("ulimit.memlock", "ok", {}, {}, {}),
    ("ulimit.memlock", "warn", {}, {"rlimit_memlock": [8 * MiB, 8 * MiB]}, {}),
    ("ulimit.memlock", "fail", {IB_PORT + "state": "4: ACTIVE"}, {"rlimit_memlock": [8 * MiB, 8 * MiB]}, {}),
    ("ulimit.nofile", "ok", {}, {}, {}),
    ("ulimit.nofile", "warn", {}, {"rlimit_nofile": [4096, 1048576]}, {}),
    ("ulimit.nofile", "fail", {}, {"rlimit_nofile": [256, 4096]}, {}),
    ("mem.shm", "ok", {}, {}, {"ranks_per_node": 8}),
    ("mem.shm", "warn", {}, {"statvfs:/dev/shm": {"total": 2 * GiB, "free": 2 * GiB}}, {"ranks_per_node": 4}),
    ("mem.shm", "fail", {}, {"statvfs:/dev/shm": {"total": 64 * MiB, "free": 64 * MiB}}, {}),
    ("mem.shm", "fail", {}, {"statvfs:/dev/shm": None}, {}),
    ("cgroup.cpu", "ok", {}, {}, {}),
    ("cgroup.cpu", "ok", {"sys/fs/cgroup/cpu.max": "400000 100000"}, {}, {"ranks_per_node": 4}),
    ("cgroup.cpu", "warn", {"sys/fs/cgroup/cpu.max": "200000 100000"}, {"env": {"OMP_NUM_THREADS": "2"}},
     {"ranks_per_node": 2}),
    ("cgroup.cpu", "fail", {"sys/fs/cgroup/cpu.max": "100000 100000"}, {}, {"ranks_per_node": 2}),
    ("cgroup.cpu", "fail", {"proc/self/cgroup": "4:cpu,cpuacct:/docker/abc\n",
                            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "50000",
                            "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000",
                            "sys/fs/cgroup/cpu.max": None}, {}, {}),
    ("cgroup.memory", "ok", {}, {}, {}),
    ("cgroup.memory", "warn", {"proc/self/cgroup": "0::/job.slice/rank.scope\n",  # the parent's limit counts
                               "sys/fs/cgroup/job.slice/memory.max": str(3 * GiB),
                               "sys/fs/cgroup/job.slice/rank.scope/memory.max": "max"}, {}, {}),
    ("cgroup.memory", "ok", {"sys/fs/cgroup/memory.max": str(64 * GiB)}, {}, {"ranks_per_node": 8}),
    ("cgroup.memory", "warn", {"sys/fs/cgroup/memory.max": str(3 * GiB)}, {}, {}),
    ("cgroup.memory", "fail", {"sys/fs/cgroup/memory.max": str(GiB)}, {}, {}),
    ("cgroup.memory", "fail", {"proc/self/cgroup": "9:memory:/\n", "sys/fs/cgroup/memory.max": None,
                               "sys/fs/cgroup/memory/memory.limit_in_bytes": str(3 * GiB)}, {},
     {"ranks_per_node": 2}),
    ("sched.policy", "ok", {}, {}, {}),
    ("sched.policy", "warn", {"proc/sys/kernel/sched_rt_runtime_us": "-1"}, {}, {}),
    ("sched.policy", "fail", {}, {"sched": {"policy": "SCHED_FIFO", "priority": 99, "nice": 0}}, {}),
    ("sched.granularity", "ok", {}, {}, {}),
    ("sched.granularity", "warn", {"proc/sys/kernel/sched_min_granularity_ns": "200000"}, {}, {}),
    ("sched.granularity", "fail", {"proc/sys/kernel/sched_min_granularity_ns": "99"}, {}, {}),
    ("sched.granularity", "fail", {"proc/sys/kernel/sched_min_granularity_ns": None,
                                   "sys/kernel/debug/sched/min_granularity_ns": "99"}, {}, {}),
    ("sched.granularity", "skip", {"proc/sys/kernel/sched_min_granularity_ns": None}, {}, {}),
    ("gpu.driver", "ok", {}, {}, {}),
    ("gpu.driver", "warn", {}, {"gpu": gpus(driver="560.35.03")}, {}),
    ("gpu.driver", "warn", {}, {"gpu": gpus(cuda_runtime=None)}, {}),
    ("gpu.driver", "fail", {}, {"gpu": gpus(driver="470.82.01")}, {}),
    ("gpu.driver", "skip", {}, {"gpu": NO_GPU}, {}),
    ("gpu.persistence", "ok", {}, {}, {}),
    ("gpu.persistence", "warn", {}, {"gpu": gpus(persistence=False)}, {}),
    ("gpu.persistence", "skip", {}, {"gpu": NO_GPU}, {}),
    ("gpu.compute_mode", "ok", {}, {}, {}),
    ("gpu.compute_mode", "ok", {}, {"gpu": gpus(compute_mode="Exclusive_Process")}, {"ranks_per_node": 2}),
    ("gpu.compute_mode", "warn", {}, {"gpu": gpus(compute_mode="Exclusive_Thread")}, {}),
    ("gpu.compute_mode", "fail", {}, {"gpu": gpus(compute_mode="Prohibited")}, {}),
    ("gpu.compute_mode", "fail", {}, {"gpu": gpus(compute_mode="Exclusive_Process")}, {"ranks_per_node": 4}),
    ("gpu.ecc", "ok", {}, {}, {}),
    ("gpu.ecc", "warn", {}, {"gpu": gpus(ecc=False)}, {}),
    ("gpu.ecc", "fail", {}, {"gpu": gpus(retired_pending=True)}, {}),
    ("gpu.ecc", "fail", {}, {"gpu": gpus(remap_pending=True)}, {}),
    ("gpu.clocks", "ok", {}, {}, {}),
    ("gpu.clocks", "warn", {}, {"gpu": gpus(power_limit_w=500.0)}, {}),
    ("gpu.clocks", "fail", {}, {"gpu": gpus(throttle=["hw_thermal"])}, {}),
    ("gpu.topology", "ok", {}, {}, {}),
    ("gpu.topology", "ok", {}, {"gpu": gpus(gpus=[GPU], links=[])}, {}),
    ("gpu.topology", "warn", {}, {"gpu": gpus(links=[{"a": 0, "b": 1, "link": "SYS"}])}, {}),
    ("gpu.topology", "skip", {}, {"gpu": NO_GPU}, {}),
    ("gpu.nccl", "ok", {}, {}, {}),
    ("gpu.nccl", "warn", {}, {"gpu": gpus(nccl=None)}, {}),
    ("gpu.nccl", "skip", {}, {"gpu": NO_GPU}, {}),
    ("net.interface", "ok", {}, {}, {}),
    ("crypto.seal", "ok", {}, {}, {}),
    ("crypto.seal", "warn", {"proc/cpuinfo": "flags\t\t: fpu sse2"}, {}, {}),
    ("crypto.seal", "warn", {}, {"seal_bytes_per_s": 0.4e9}, {}),
    ("crypto.seal", "skip", {}, {"seal_bytes_per_s": None}, {}),
    ("net.interface", "ok", {}, {"addresses": {"lo": "127.0.0.1"}}, {}),
    ("net.interface", "warn", {"sys/class/net/eth0/speed": "1000"}, {}, {}),
    ("net.interface", "warn", {"sys/class/net/eth0/mtu": "1400"}, {}, {}),
    ("net.interface", "fail", {}, {"addresses": {"lo": "127.0.0.1"}}, {"multi_host": True}),
    ("net.interface", "fail", {}, {"env": {"HVPS_NETWORK_INTERFACE": "ib0"}}, {}),
    ("net.interface", "fail", {"sys/class/net/eth0/operstate": "down"}, {}, {}),
    ("net.interface", "fail", {}, {"addresses": {}}, {}),
    ("net.interface", "warn", {}, {"env": {"HVPS_CONTROL_ADDR": "192.0.2.7"}}, {}),  # no interface here holds it
    ("net.interface", "fail", {}, {"env": {"HVPS_CONTROL_ADDR": "127.0.0.1"}}, {"multi_host": True}),
    ("net.mpi_tcp", "ok", {}, {}, {}),
    ("net.mpi_tcp", "ok", {}, {"env": {"OMPI_MCA_btl": "self,sm"}}, {"world_size": 2}),
    ("net.mpi_tcp", "warn", {}, {"env": {"OMPI_COMM_WORLD_SIZE": "2"}}, {}),
    ("net.mpi_tcp", "skip", {}, {"software": dict(HEALTHY_FACTS["software"], mpi="MPICH 4.2.0")}, {}),
    ("net.rdma", "ok", {}, {}, {}),
    ("net.rdma", "ok", {IB_PORT + "state": "4: ACTIVE", IB_PORT + "link_layer": "Ethernet"}, {}, {}),
    ("net.rdma", "warn", {IB_PORT + "state": "1: DOWN", IB_PORT + "link_layer": "InfiniBand"}, {}, {}),
    ("net.ifname", "ok", {}, {}, {}),
    ("net.ifname", "ok", {}, {"env": {"NCCL_SOCKET_IFNAME": "eth", "HVPS_NETWORK_INTERFACE": "eth0"}}, {}),
    ("net.ifname", "ok", {}, {"env": {"NCCL_SOCKET_IFNAME": "^docker,lo", "HVPS_NETWORK_INTERFACE": "eth0"}}, {}),
    ("net.ifname", "warn", {}, {"env": {"HVPS_NETWORK_INTERFACE": "eth0"}}, {}),
    ("net.ifname", "fail", {}, {"env": {"NCCL_SOCKET_IFNAME": "=lo", "HVPS_NETWORK_INTERFACE": "eth0"}}, {}),
    ("net.ifname", "fail", {}, {"env": {"NCCL_SOCKET_IFNAME": "ib", "HVPS_NETWORK_INTERFACE": "eth0"}}, {}),
    ("net.ifname", "fail", {}, {"env": {"NCCL_SOCKET_IFNAME": "eth1", "HVPS_NETWORK_INTERFACE": "eth1"}}, {}),
    ("software", "ok", {}, {}, {}),
    ("software", "warn", {}, {"software": {"python": "3.11.7", "hvps": "0.1.0", "torch": None}, "gpu": NO_GPU}, {}),
    ("os", "ok", {}, {}, {}),
    ("os", "skip", {"etc/os-release": None, "proc/sys/kernel/osrelease": None}, {}, {}),
    ("cpu.smt", "ok", {}, {"env": {"OMP_NUM_THREADS": "not-a-number"}}, {"ranks_per_node": 1}),
    ("container", "ok", {}, {}, {}),
    ("container", "ok", {}, {}, {"container": "docker"}),
]


def _id(case) -> str:
    name, verdict, files, facts, ctx = case
    return f"{name}-{verdict}-" + "-".join(sorted(files) + sorted(facts) + sorted(ctx))[:60]


@pytest.mark.unit
@pytest.mark.parametrize("case", CASES, ids=[_id(c) for c in CASES])
def test_check_verdicts(tmp_path, case):
    name, verdict, files, facts, ctx = case
    result = REGISTRY[name].func(Host(str(make_tree(tmp_path, files, facts))), Context(**ctx))
    assert result.verdict == verdict, result
    assert result.name == name and result.value and result.why
    if verdict in ("warn", "fail"):
        assert result.fix, f"{name} gives no fix for {verdict}"


def test_every_check_has_cases_and_a_healthy_tree_is_all_ok(tmp_path):
    assert {c[0] for c in CASES} == set(REGISTRY)
    rows = collect(Host(str(make_tree(tmp_path))), Context())
    assert {r.name: r.verdict for r in rows} == {name: "ok" for name in REGISTRY}


@pytest.mark.unit
def test_no_gpu_is_skip_with_the_reason(tmp_path):
    rows = collect(Host(str(make_tree(tmp_path, facts={"gpu": NO_GPU}))), Context(), only="gpu")
    assert {r.verdict for r in rows} == {"skip"}
    assert "NVMLError_LibraryNotFound" in rows[0].value


@pytest.mark.unit
def test_driver_table_and_nccl_interface_matching():
    assert driver_verdict("580.65.06", "13.0")[0] == "ok"
    assert driver_verdict("535.104.05", "12.4")[0] == "warn"  # minor-version compatibility only
    assert driver_verdict("535.104.05", "12.2")[0] == "ok"
    assert driver_verdict("525.60.13", "12.7")[0] == "warn"   # unlisted minor: nearest older (12.6)
    assert driver_verdict("450.80.02", "12.1")[0] == "fail"
    assert nccl_matches("eth,ib", "ib0") and not nccl_matches("=eth", "eth0")
    assert nccl_matches("^docker", "eth0") and not nccl_matches("^docker", "docker0")


@pytest.mark.parametrize("files,env,expected", [
    ({}, {}, None),
    ({".dockerenv": ""}, {}, "docker"),
    ({"run/.containerenv": ""}, {}, "podman"),
    ({"proc/1/cgroup": "0::/kubepods.slice/kubepods-burstable.slice/cri-containerd-1.scope"}, {}, "kubernetes"),
    ({"proc/1/cgroup": "12:memory:/docker/0123abcd"}, {}, "docker"),
    ({}, {"KUBERNETES_SERVICE_HOST": "10.96.0.1"}, "kubernetes"),
])
@pytest.mark.unit
def test_container_detection_and_its_fixes(tmp_path, files, env, expected):
    host = Host(str(make_tree(tmp_path, files, {"env": env, "statvfs:/dev/shm": {"total": 64 * MiB, "free": 0},
                                                "rlimit_memlock": [65536, 65536]})))
    runtime = detect_container(host)
    assert runtime == expected
    rows = {r.name: r for r in collect(host, Context(container=runtime), only="memory,container")}
    assert rows["container"].value == (expected or "none detected")
    assert rows["mem.shm"].verdict == "fail"
    if expected:
        assert "--ipc=host" in rows["mem.shm"].fix and "--ulimit memlock=-1" in rows["ulimit.memlock"].fix
    else:
        assert "remount" in rows["mem.shm"].fix and "limits.conf" in rows["ulimit.memlock"].fix


def doctor(capsys, *args) -> tuple:
    rc = cli.main(["doctor", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.mark.unit
def test_json_report_structure_and_exit_status(tmp_path, capsys):
    rc, out, _ = doctor(capsys, "--root", str(make_tree(tmp_path / "a")), "--json")
    report = json.loads(out)
    assert rc == 0 and report["exit_status"] == 0 and report["ranks"] == 1 and report["hosts"] == ["node-a"]
    assert [c["name"] for c in report["checks"]] == list(REGISTRY)
    for c in report["checks"]:
        assert set(c) >= {"name", "verdict", "value", "why", "fix", "data"}
    assert report["summary"]["ok"] == len(REGISTRY)
    rc, out, _ = doctor(capsys, "--root", str(make_tree(tmp_path / "b", facts={
        "sched": {"policy": "SCHED_FIFO", "priority": 99, "nice": 0}})), "--json", "--only", "cpu")
    report = json.loads(out)
    assert rc == 1 and report["summary"]["fail"] == 1
    assert {c["name"] for c in report["checks"]} == {n for n, s in REGISTRY.items() if s.group == "cpu"}


@pytest.mark.unit
def test_table_output(tmp_path, capsys):
    tree = make_tree(tmp_path, {THP + "enabled": "[always] madvise never"}, {"gpu": NO_GPU})
    rc, out, _ = doctor(capsys, "--root", str(tree))
    lines = out.splitlines()
    assert rc == 0 and lines[1].split() == ["CHECK", "VERDICT", "VALUE"]
    thp_row = next(i for i, line in enumerate(lines) if line.startswith("mem.thp"))
    assert lines[thp_row].split()[1] == "warn"
    assert "why:" in lines[thp_row + 1] and "fix: hvps doctor --apply thp" in lines[thp_row + 2]
    assert "gpu.driver         skip    no GPU: NVML" in out
    assert lines[-1].startswith("summary: ") and "(exit status 0)" in lines[-1]
    out_file = tmp_path / "report.txt"
    assert doctor(capsys, "--root", str(tree), "--output", str(out_file))[1] == ""
    assert out_file.read_text() == out


@pytest.mark.unit
def test_help_and_bad_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["doctor", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--json", "--output", "--verbose", "--only", "--all-ranks", "--ranks-per-node", "--root",
                 "--apply", "--revert", "--yes", "--state", "exit status", "rt-priority"):
        assert flag in text
    with pytest.raises(SystemExit) as exc:
        cli.main(["doctor", "--bogus"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "unrecognized arguments: --bogus" in err
    assert "Run 'hvps doctor --help' to see every option" in err  # the subcommand that got the flag
    rc, _, err = doctor(capsys, "--only", "bogus")
    assert rc == 2 and "groups: " in err
    rc, _, err = doctor(capsys, "--all-ranks", "--apply", "thp")
    assert rc == 2 and "without --all-ranks" in err


APPLY_FILES = {THP + "enabled": "[always] madvise never",
               THP + "defrag": "[always] defer defer+madvise madvise never",
               CPUFREQ.format(0) + "scaling_governor": "powersave",
               CPUFREQ.format(1) + "scaling_governor": "schedutil"}


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


@pytest.mark.unit
def test_apply_and_revert_round_trip(tmp_path, capsys):
    tree = make_tree(tmp_path / "t", APPLY_FILES, {"gpu": gpus(persistence=False)})
    before = _snapshot(tree)
    rc, out, _ = doctor(capsys, "--root", str(tree), "--apply", "--yes")
    assert rc == 0, out
    assert (tree / THP / "enabled").read_text() == "always [madvise] never\n"
    assert (tree / THP / "defrag").read_text() == "always defer defer+madvise [madvise] never\n"
    assert (tree / CPUFREQ.format(0) / "scaling_governor").read_text() == "performance\n"
    assert (tree / "commands.log").read_text() == "nvidia-smi -i 1 -pm 1\n"
    state = json.loads((tree / "var/lib/hvps/doctor-state.json").read_text())
    assert [c["action"] for c in state["changes"]] == ["thp", "thp", "governor", "governor", "persistence"]
    rc, out, _ = doctor(capsys, "--root", str(tree), "--only", "mem.thp,cpu.governor")
    assert rc == 0 and "2 ok, 0 warn" in out
    rc, out, _ = doctor(capsys, "--root", str(tree), "--apply", "thp", "--yes")
    assert rc == 2 and "--revert' first" in out  # one unreverted record at a time
    rc, out, _ = doctor(capsys, "--root", str(tree), "--revert")
    assert rc == 0 and "every recorded change reverted" in out
    after = _snapshot(tree)
    assert after.pop("commands.log") == b"nvidia-smi -i 1 -pm 1\nnvidia-smi -i 1 -pm 0\n"
    assert after == before
    assert doctor(capsys, "--root", str(tree), "--revert")[0] == 0  # nothing left: a no-op


@pytest.mark.unit
def test_apply_asks_first_and_a_no_changes_nothing(tmp_path):
    tree = make_tree(tmp_path, APPLY_FILES)
    before, lines = _snapshot(tree), []

    class Out:
        def write(self, text):
            lines.append(text)

    state = tmp_path / "state.json"
    assert apply(Host(str(tree)), ["thp"], state, yes=False, out=Out(), answer=lambda prompt: "n") == 2
    assert _snapshot(tree) == before and not state.exists()
    assert apply(Host(str(tree)), ["thp"], state, yes=False, out=Out(), answer=lambda prompt: "y") == 0
    assert (tree / THP / "enabled").read_text().startswith("always [madvise]")
    assert revert(Host(str(tree)), state, out=Out()) == 0 and _snapshot(tree) == before
    assert apply(Host(str(tree)), ["nonsense"], state, yes=True, out=Out()) == 2
    assert "choose from thp, governor, persistence" in "".join(lines)


@pytest.mark.unit
@pytest.mark.parametrize("action,reason", [("rt-priority", "starves kernel threads"),
                                           ("min-granularity", "context switches")])
def test_apply_refuses_the_seeds_unsafe_advice(tmp_path, capsys, action, reason):
    tree = make_tree(tmp_path, APPLY_FILES)
    before = _snapshot(tree)
    rc, out, _ = doctor(capsys, "--root", str(tree), "--apply", f"thp,{action}", "--yes")
    assert rc == 2 and f"refusing --apply {action}" in out and reason in out
    assert _snapshot(tree) == before


def test_this_machine_as_it_is():
    """The real machine, in a fresh process: the report parses and the exit status follows the verdicts."""
    proc = subprocess.run([sys.executable, "-m", "hvps.doctor", "--json"], capture_output=True, text=True,
                          timeout=60, cwd=REPO_ROOT)
    report = json.loads(proc.stdout)
    assert proc.returncode == report["exit_status"] == int(report["summary"]["fail"] > 0), proc.stderr
    assert [c["name"] for c in report["checks"]] == list(REGISTRY)
    rows = {c["name"]: c for c in report["checks"]}
    assert rows["software"]["data"]["hvps"] and rows["sched.policy"]["verdict"] == "ok"


@pytest.mark.unit
def test_merge_names_the_ranks_that_differ():
    rows = [{"rank": r, "host": h, "checks": [{"name": "software", "verdict": "ok", "value": f"torch {v}",
                                               "why": "w", "fix": "", "data": {"torch": v, "hvps": "0.1"}},
                                              {"name": "mem.swappiness", "verdict": "ok", "value": s,
                                               "why": "w", "fix": "", "data": {}},
                                              {"name": "mem.thp", "verdict": "ok", "value": f"enabled={t}",
                                               "why": "w", "fix": "", "data": {}}]}
            for r, h, v, s, t in ((0, "a", "2.13.0", "10", "madvise"), (1, "a", "2.13.0", "10", "madvise"),
                                  (2, "b", "2.0.0", "1", "never"))]
    report = merge(rows)
    sw, swap, thp = report["checks"]
    assert thp["verdict"] == "warn" and "enabled=never on rank 2" in thp["value"]  # a setting: warn
    assert sw["verdict"] == "fail" and "torch: 2.13.0 on ranks 0,1; 2.0.0 on rank 2" in sw["value"]
    assert swap["verdict"] == "ok" and "rank 2 (b): 1" in swap["value"]  # may differ: shown, not failed
    assert report["exit_status"] == 1 and report["hosts"] == ["a", "b"]


def _hvpsrun() -> str:
    return str(Path(sys.executable).with_name("hvpsrun"))


def test_hvpsrun_doctor_three_ranks_one_table():
    proc = subprocess.run([_hvpsrun(), "-np", "3", "--doctor"], capture_output=True, text=True, timeout=120,
                          cwd=REPO_ROOT)
    out = proc.stdout
    assert proc.returncode in (0, 1), proc.stderr
    assert out.count("VERDICT") == 1 and "hvps doctor: 3 rank(s)" in out, out + proc.stderr
    assert "(all 3 ranks)" in out and f"(exit status {proc.returncode})" in out


def test_two_ranks_flag_a_version_mismatch(tmp_path):
    for rank, torch in ((0, "2.13.0"), (1, "2.12.0")):
        sw = dict(HEALTHY_FACTS["software"], torch=torch)
        make_tree(tmp_path / f"tree{rank}", facts={"software": sw, "hostname": f"node-{rank}"})
    out = tmp_path / "report.json"
    argv = [sys.executable, "-m", "hvps.doctor", "--all-ranks", "--json", "--output", str(out),
            "--root", str(tmp_path / "tree{rank}")]
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMPI_MCA_rmaps_base_oversubscribe="1")
    cmd, env = mpirun_argv(2, argv, env)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    rows = {c["name"]: c for c in report["checks"]}
    assert report["ranks"] == 2 and report["hosts"] == ["node-0", "node-1"]
    assert report["context"]["multi_host"] is True
    assert rows["software"]["verdict"] == "fail"
    assert "torch: 2.13.0 on rank 0; 2.12.0 on rank 1" in rows["software"]["value"]
    assert [c["name"] for c in report["checks"] if c["verdict"] == "fail"] == ["software"]


FAKE_SMI = """#!/bin/sh
if [ "$1" = topo ]; then
  printf '\tGPU0\tGPU1\tCPU Affinity\nGPU0\t X \tSYS\t0-15\nGPU1\tSYS\t X \t16-31\n'
else
  echo '0, NVIDIA H200, 570.86.15, Enabled, Default, Enabled, No, 1980, 1980, 700.00, 700.00, 00000000:18:00.0'
  echo '1, NVIDIA H200, 570.86.15, Disabled, Exclusive_Process, Disabled, Yes, 345, 1980, 500.00, 700.00, 00000000:2A:00.0'
fi
"""


def test_nvidia_smi_fallback_parses_its_csv_and_topology(tmp_path):
    """The parser of nvidia-smi's output (used when pynvml is missing), fed the format it prints."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    facts = _from_smi(str(smi))
    assert facts["driver"] == "570.86.15" and facts["links"] == [{"a": 0, "b": 1, "link": "SYS"}]
    g0, g1 = facts["gpus"]
    assert g0["persistence"] and g0["ecc"] and g0["compute_mode"] == "Default" and not g0["retired_pending"]
    assert (not g1["persistence"] and g1["ecc"] is False and g1["retired_pending"]
            and g1["compute_mode"] == "Exclusive_Process" and g1["power_limit_w"] == 500.0)
    host = Host(str(make_tree(tmp_path / "t", facts={"gpu": dict(facts, cuda_runtime="12.8", nccl="2.26.2")})))
    verdicts = {r.name: r.verdict for r in collect(host, Context(), only="gpu")}
    assert verdicts == {"gpu.driver": "ok", "gpu.persistence": "warn", "gpu.compute_mode": "ok", "gpu.ecc": "fail",
                        "gpu.clocks": "warn", "gpu.topology": "warn", "gpu.nccl": "ok"}


def test_hvpsrun_doctor_runs_before_the_command(capsys):
    from hvps.runner.launch import main as hvpsrun

    # the running interpreter, not "python": a Debian machine may have only python3 on PATH
    assert hvpsrun(["-np", "2", "--doctor", "--dry-run", sys.executable, "-c", "pass"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 and lines[0].endswith("-m hvps.doctor --all-ranks") and lines[1].endswith("-c pass")
