"""The GPU sbatch scripts (jobs/slurm/*gpu*.sbatch) without GPUs.

Three layers:

* their ``#SBATCH`` lines, read as text: one rank per GPU (``--gres=gpu:N`` per node equal to
  ``--ntasks-per-node``), ``--cpus-per-task``, no ``--gpus-per-task`` (each task would then see
  only its own GPU as device 0, and the harness pins rank to ``cuda:LOCAL_RANK``);
* the commands they start, rendered with ``DRY_RUN=1`` (jobs/common.sh's ``run_step``) under a
  fake allocation: launcher, ``--cuda``, NCCL settings only when given, the doctor prolog;
* a real Slurm (tests/slurm_cluster.py's class, as test_slurm.py starts it). A cluster without
  GPUs rejects any GPU request at submission ('Invalid generic resource (gres)
  specification', even with ``--test-only``). So a second cluster gets *emulated* GPUs:
  ``GresTypes=gpu``, ``Gres=gpu:2`` on the node and a gres.conf naming two character devices
  with /dev/null's numbers in the cluster's private directory (slurmd refuses plain files).
  Slurm counts and allocates them (it sets CUDA_VISIBLE_DEVICES and SLURM_GPUS_ON_NODE);
  nothing computes on them. On it ``sbatch --test-only`` accepts the scripts sized to this
  node, refuses more GPUs than the node has ('Requested node configuration is not
  available'), and the single-node script runs for real with a tiny CPU benchmark.
"""

from __future__ import annotations

import os
import re
import shlex
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from slurm_cluster import SlurmCluster, unusable_reason

JOBS = REPO_ROOT / "jobs" / "slurm"
SCRIPTS = {"resnet50-gpu.sbatch": 1, "resnet50-multinode-gpu.sbatch": 2}  # script -> nodes
TINY_BENCH = ("--batch-size 2 --image-size 32 --num-warmup-batches 1 --num-batches-per-iter 1 --num-iters 2 "
              "--threads-per-rank 1")
EMULATED_GPUS = 2
# sized to this machine: 2 ranks, 1 CPU and 1 (emulated) GPU each
FITS_HERE = ("--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=1", f"--gres=gpu:{EMULATED_GPUS}")

_REASON = unusable_reason()
needs_slurm = pytest.mark.skipif(_REASON is not None, reason=f"no Slurm cluster here: {_REASON}")


def _sbatch_options(script: Path) -> dict:
    opts = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            opts[m.group(1)] = m.group(2)
    return opts


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_sbatch_lines_ask_one_gpu_per_rank(name):
    opts = _sbatch_options(JOBS / name)
    assert opts["nodes"] == str(SCRIPTS[name])
    gres = re.fullmatch(r"gpu:(\d+)", opts["gres"])
    assert gres and gres.group(1) == opts["ntasks-per-node"], opts
    assert int(opts["cpus-per-task"]) >= 1
    assert "gpus-per-task" not in opts and "gpus" not in opts, "the harness pins by local rank: see the header"


def _fake_allocation(tmp_path: Path, nodes: int, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "NCCL_"))}
    env.update(SLURM_JOB_ID="4242", SLURM_NTASKS=str(4 * nodes), SLURM_NTASKS_PER_NODE="4",
               SLURM_JOB_NUM_NODES=str(nodes), SLURM_JOB_NODELIST="gpu[1-2]" if nodes > 1 else "gpu1",
               SLURM_CPUS_PER_TASK="8", SLURM_GPUS_ON_NODE="4", SLURM_SUBMIT_DIR=str(REPO_ROOT),
               HVPS_REPO=str(REPO_ROOT), HVPS_PYTHON=sys.executable, RESULTS_DIR=str(tmp_path / "results"),
               DRY_RUN="1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _dry_run(name: str, env: dict) -> tuple:
    proc = subprocess.run(["bash", str(JOBS / name)], env=env, capture_output=True, text=True, timeout=60,
                          cwd=REPO_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [shlex.split(line[len("dry-run:"):]) for line in proc.stdout.splitlines() if line.startswith("dry-run:")]
    return proc.stdout, steps


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_dry_run_srun_path(name, tmp_path):
    nodes = SCRIPTS[name]
    out, steps = _dry_run(name, _fake_allocation(tmp_path, nodes, LAUNCHER="srun"))
    assert [s[:2] for s in steps] == [["srun", "--mpi=pmix"]] * 2, out  # preflight, benchmark
    bench = steps[-1]
    assert bench[bench.index(sys.executable) + 1].endswith("benchmarks/pytorch_synthetic_benchmark.py")
    assert "--cuda" in bench and bench[bench.index("--threads-per-rank") + 1] == "8"
    assert bench[-1] == str(tmp_path / "results" / f"resnet50-gpu-{nodes}n-4242.json")
    assert "NCCL settings: none" in out and "hvps doctor" not in out
    assert "warning" not in out


def test_dry_run_mpirun_path_with_nccl_and_doctor(tmp_path):
    env = _fake_allocation(tmp_path, 1, LAUNCHER="mpirun", HVPS_DOCTOR="1", NIC="ib0", IB_HCA="mlx5_0,mlx5_1",
                           SLURM_GPUS_ON_NODE="2")
    out, steps = _dry_run("resnet50-gpu.sbatch", env)
    hvpsrun = str(Path(sys.executable).parent / "hvpsrun")
    assert [s[:4] for s in steps] == [[hvpsrun, "--launcher", "mpirun", "-np"]] * 3, out
    assert steps[0][5:] == [str(Path(sys.executable).parent / "hvps"), "doctor", "--all-ranks"]
    assert "NCCL settings: NCCL_IB_HCA=mlx5_0,mlx5_1 NCCL_SOCKET_IFNAME=ib0" in out
    assert "4 tasks per node but 2 GPUs" in out


def test_nccl_variables_of_the_user_pass_through(tmp_path):
    out, _ = _dry_run("resnet50-gpu.sbatch", _fake_allocation(tmp_path, 1, LAUNCHER="srun",
                                                              NCCL_SOCKET_IFNAME="eth2"))
    assert "NCCL settings: NCCL_SOCKET_IFNAME=eth2" in out


# -- a real Slurm ------------------------------------------------------------------------------
class EmulatedGpuCluster(SlurmCluster):
    """The test cluster plus ``gpus`` GPUs that Slurm can count and allocate (see the module doc)."""

    def __init__(self, workdir: Path, gpus: int = EMULATED_GPUS) -> None:
        super().__init__(workdir)
        self.gpus = gpus

    def _write_conf(self) -> None:
        super()._write_conf()
        devices = self.dir / "fake-gpus"
        devices.mkdir(exist_ok=True)
        for i in range(self.gpus):
            os.mknod(devices / f"nvidia{i}", stat.S_IFCHR | 0o666, os.makedev(1, 3))  # /dev/null's numbers
        (self.dir / "gres.conf").write_text(
            f"AutoDetect=off\nNodeName={self.node} Name=gpu File={devices}/nvidia[0-{self.gpus - 1}]\n")
        node_line = f"NodeName={self.node} "
        text = self.conf.read_text()
        assert node_line in text, text
        self.conf.write_text(text.replace(node_line, f"GresTypes=gpu\n{node_line}Gres=gpu:{self.gpus} "))


def _cluster(cls, tmp_path_factory, name):
    cluster = cls(tmp_path_factory.mktemp(name))
    cluster.start()
    return cluster


@pytest.fixture(scope="module")
def gpu_slurm(tmp_path_factory):
    cluster = _cluster(EmulatedGpuCluster, tmp_path_factory, "slurm-gpu")
    try:
        yield cluster
    finally:
        cluster.stop()


def _test_only(cluster: SlurmCluster, script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["sbatch", "--test-only", *args, str(JOBS / script)], env=cluster.env(),
                          capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)


@needs_slurm
def test_cluster_without_gpus_rejects_gpu_requests(tmp_path_factory):
    cluster = _cluster(SlurmCluster, tmp_path_factory, "slurm-nogpu")
    try:
        proc = _test_only(cluster, "resnet50-gpu.sbatch", *FITS_HERE)
    finally:
        cluster.stop()
    assert proc.returncode != 0
    assert "Invalid generic resource (gres) specification" in proc.stderr, proc.stderr


@needs_slurm
@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_test_only_accepts_gpu_scripts_sized_to_the_node(gpu_slurm, name):
    proc = _test_only(gpu_slurm, name, *FITS_HERE)
    assert proc.returncode == 0 and "to start at" in proc.stderr, proc.stdout + proc.stderr


@needs_slurm
def test_test_only_refuses_more_gpus_than_the_node_has(gpu_slurm):
    proc = _test_only(gpu_slurm, "resnet50-gpu.sbatch", *FITS_HERE[:-1], f"--gres=gpu:{EMULATED_GPUS + 1}")
    assert proc.returncode != 0
    assert "Requested node configuration is not available" in proc.stderr, proc.stderr


@needs_slurm
def test_test_only_reads_the_scripts_own_sizes(gpu_slurm):
    """Unchanged, the scripts ask 4 tasks x 8 CPUs (and 2 nodes): more than this 2-CPU node has."""
    for name in SCRIPTS:
        proc = _test_only(gpu_slurm, name)
        assert proc.returncode != 0 and "Requested node configuration is not available" in proc.stderr, name


@needs_slurm
def test_gpu_script_runs_on_emulated_gpus(gpu_slurm, tmp_path):
    """The whole script under Slurm with its GPU allocation; the benchmark runs on CPU (no --cuda)."""
    env = dict(os.environ, HVPS_REPO=str(REPO_ROOT), HVPS_PYTHON=sys.executable,
               RESULTS_DIR=str(tmp_path / "results"), GPU_BENCH_ARGS=TINY_BENCH, HVPS_DOCTOR="warn",
               HVPS_STALL_CHECK_TIME_SECONDS="60", PYTHONUNBUFFERED="1")
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    job, rc, out = gpu_slurm.sbatch(JOBS / "resnet50-gpu.sbatch", *FITS_HERE, f"--output={tmp_path}/job-%j.out",
                                    env=env, cwd=REPO_ROOT, timeout=240)
    log_file = tmp_path / f"job-{job}.out"
    log = log_file.read_text() if log_file.exists() else ""
    assert rc == 0, f"rc={rc}: {out}\n{log}\n{gpu_slurm.logs()}"
    assert f"2 tasks on 1 node(s) ({gpu_slurm.node}), GPUs per node: {EMULATED_GPUS}, CPUs per task: 1" in log
    assert "NCCL settings:" in log and "hvps doctor" in log
    assert (tmp_path / "results" / f"resnet50-gpu-1n-{job}.json").exists(), log
