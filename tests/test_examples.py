"""Every command of ``tests/examples_commands.py`` (the ones ``examples/README.md`` gives), run for real as a
user would type it from the repository root, with real ranks, at the small sizes the commands ask for.

The commands run in a scratch directory holding a link to ``examples/``, so that their relative paths
(``examples/...``, ``checkpoints/...``) work unchanged and nothing is written into the repository. ``python``
becomes this interpreter, ``hvpsrun`` the one installed beside it, ``torchrun`` this interpreter's
``torch.distributed.run`` and ``mpirun`` the one hvpsrun would pick. The assertions read what the scripts
print on rank 0 and what they write: the loss falls, the checkpoints exist, a resume continues from the
saved epoch on another number of ranks, the elastic jobs finish.

Plus cheap checks without a launch: every command is run by exactly one test below, every example is
launched by some command and listed in ``examples/README.md``, and every flag has a ``--help`` text.
"""

from __future__ import annotations

import ast
import os
import re
import resource
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import REPO_ROOT
from examples_commands import EXAMPLE_COMMANDS

from hvps.core.mpi_env import mpi_defaults
from hvps.runner.mpi_discovery import find_mpirun

EXAMPLES_DIR = REPO_ROOT / "examples"
#: the scripts' rank-0 lines, behind whatever tag the launcher puts in front ("[1,0]<stdout>: ", "[0]<stdout>:")
EPOCH_LINE = re.compile(r"epoch (\d+): loss ([0-9.]+)")
STEP_LINE = re.compile(r"step (\d+): loss ([0-9.]+)")
#: variables of an enclosing MPI or hvps job, which must not leak into the launched one
INHERITED_JOB = ("OMPI_COMM_WORLD", "OMPI_UNIVERSE", "PMIX_", "PMI_", "HVPS_", "PRTE_", "HOROVOD_")


def command(*words: str) -> str:
    """The one command of EXAMPLE_COMMANDS that contains every one of ``words``."""
    found = [c for c in EXAMPLE_COMMANDS if all(w in c.split() for w in words)]
    assert len(found) == 1, f"{words} matches {len(found)} commands: {found}"
    return found[0]


PYTORCH_TRAIN = command("examples/pytorch_train.py", "hvpsrun", "-np", "2")
PYTORCH_RESUME = command("examples/pytorch_train.py", "--resume")
PYTORCH_TORCHRUN = command("examples/pytorch_train.py", "torchrun")
KERAS_FIT = command("examples/keras_fit.py")
TF_GRADIENT_TAPE = command("examples/tf_gradient_tape.py")
PYTORCH_ELASTIC = command("examples/pytorch_elastic.py")
KERAS_ELASTIC = command("examples/keras_elastic.py")
SHARDED_STORE = command("examples/sharded_store.py")
COMPRESSION = {name: command("examples/compression.py", name) for name in ("topk", "powersgd")}
TESTED = [PYTORCH_TRAIN, PYTORCH_RESUME, PYTORCH_TORCHRUN, KERAS_FIT, TF_GRADIENT_TAPE, PYTORCH_ELASTIC, KERAS_ELASTIC,
          SHARDED_STORE, *COMPRESSION.values()]


def program(word: str) -> list:
    """What runs in place of a command's first word (or its ``python``)."""
    if word == "python":
        return [sys.executable]
    if word == "hvpsrun":
        beside = Path(sys.executable).parent / "hvpsrun"
        return [str(beside)] if beside.exists() else [sys.executable, "-m", "hvps.runner.launch"]
    if word == "torchrun":  # a console script's shebang may name another environment's Python
        return [sys.executable, "-m", "torch.distributed.run"]
    if word == "mpirun":
        return [find_mpirun().path]
    return [word]


def example_env() -> dict:
    """This environment without an enclosing job's variables, with the repository importable and one MPI."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(INHERITED_JOB)}
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONUNBUFFERED"] = "1"
    env["HVPS_MPIRUN"] = find_mpirun().path  # hvpsrun's MPI is the one the mpirun command runs
    if os.geteuid() == 0:  # Open MPI refuses root without these (CI's containers run as root)
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return dict(mpi_defaults(env))


@dataclass
class Run:
    """A finished example command: its output and how long it took."""

    command: str
    stdout: str
    stderr: str
    seconds: float

    def output(self) -> str:
        return f"$ {self.command}  ({self.seconds:.1f} s)\n--- stdout\n{self.stdout[-4000:]}\n" \
               f"--- stderr\n{self.stderr[-6000:]}"

    def losses(self, pattern: re.Pattern = EPOCH_LINE) -> dict:
        """{epoch or step: loss} of rank 0's log lines."""
        return {int(m.group(1)): float(m.group(2)) for m in pattern.finditer(self.stdout)}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A scratch 'repository root': ``examples`` links to the real one, checkpoints land here."""
    root = tmp_path_factory.mktemp("examples-root")
    (root / "examples").symlink_to(EXAMPLES_DIR, target_is_directory=True)
    return root


def run_example(text: str, workdir: Path, timeout: float = 300) -> Run:
    """Run one command of EXAMPLE_COMMANDS in ``workdir``; fail the test unless it exits 0."""
    assert text in EXAMPLE_COMMANDS
    words = shlex.split(text)
    argv = program(words[0]) + [part for word in words[1:] for part in
                                (program(word) if word == "python" else [word])]
    started, cpu_before = time.monotonic(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(argv, cwd=workdir, env=example_env(), capture_output=True, text=True, timeout=timeout)
    run = Run(text, proc.stdout, proc.stderr, time.monotonic() - started)
    cpu_after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = cpu_after.ru_utime + cpu_after.ru_stime - cpu_before.ru_utime - cpu_before.ru_stime
    print(f"{run.seconds:6.1f} s wall {cpu:6.1f} s cpu  {text}")  # shown with pytest -s: what each command cost
    assert proc.returncode == 0, f"exit status {proc.returncode}\n{run.output()}"
    assert "done:" in run.stdout, run.output()
    return run


def assert_falls(losses: dict, run: Run) -> None:
    """The last logged loss is below the first."""
    assert len(losses) >= 2, run.output()
    ordered = [losses[k] for k in sorted(losses)]
    assert ordered[-1] < ordered[0], f"the loss did not fall: {losses}\n{run.output()}"


# -- PyTorch ---------------------------------------------------------------------------------------

def test_pytorch_train_checkpoints_then_resumes_on_three_ranks(workdir):
    first = run_example(PYTORCH_TRAIN, workdir)
    assert "pytorch_train: 2 rank(s) on cpu, starting from scratch" in first.stdout, first.output()
    losses = first.losses()
    assert sorted(losses) == [0, 1], first.output()
    assert_falls(losses, first)
    saved = workdir / "checkpoints" / "pytorch_train"
    assert sorted(p.name for p in saved.glob("ckpt-epoch-*.h5")) == ["ckpt-epoch-000000.h5", "ckpt-epoch-000001.h5"]

    resumed = run_example(PYTORCH_RESUME, workdir)
    assert "pytorch_train: 3 rank(s) on cpu, resuming at epoch 2" in resumed.stdout, resumed.output()
    assert sorted(resumed.losses()) == [2], "the resumed run trained only the epoch left\n" + resumed.output()
    assert resumed.losses()[2] < losses[0], resumed.output()
    assert (saved / "ckpt-epoch-000002.h5").is_file(), resumed.output()


def test_pytorch_train_under_torchrun(workdir):
    run = run_example(PYTORCH_TORCHRUN, workdir)
    assert "pytorch_train: 2 rank(s) on cpu" in run.stdout, run.output()
    assert sorted(run.losses()) == [0], run.output()
    assert run.losses()[0] < 2.0, f"no better than chance (ln 10 = 2.30)\n{run.output()}"
    assert (workdir / "checkpoints" / "torchrun" / "ckpt-epoch-000000.h5").is_file(), run.output()


# -- TensorFlow and Keras --------------------------------------------------------------------------

def test_keras_fit_with_the_callbacks(workdir):
    run = run_example(KERAS_FIT, workdir)
    assert "keras_fit: 2 rank(s), starting from scratch" in run.stdout, run.output()
    assert sorted(run.losses()) == [0, 1], run.output()
    assert_falls(run.losses(), run)
    assert re.search(r"epoch 1: .* lr 0\.1\b", run.stdout), "the warm-up ends at lr * 2 ranks\n" + run.output()
    saved = sorted(p.name for p in (workdir / "checkpoints" / "keras_fit").glob("ckpt-epoch-*.h5"))
    assert saved == ["ckpt-epoch-000000.h5", "ckpt-epoch-000001.h5"], run.output()


def test_tf_gradient_tape(workdir):
    run = run_example(TF_GRADIENT_TAPE, workdir)
    assert "tf_gradient_tape: 2 rank(s), 20 steps" in run.stdout, run.output()
    losses = run.losses(STEP_LINE)
    assert sorted(losses) == [5, 10, 15, 20], run.output()
    assert_falls(losses, run)


# -- elastic ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("text", [PYTORCH_ELASTIC, KERAS_ELASTIC], ids=["pytorch", "keras"])
def test_elastic_job_finishes(workdir, text):
    """The discovery script's two slots from start to end: one call of the training function, no reset. (Not
    the number of memberships hvpsrun reports: a worker still exiting when the others have finished may get
    one of its own at the very end.)"""
    run = run_example(text, workdir)
    assert "hvpsrun: all workers finished; the job ran" in run.stderr, run.output()
    assert run.stdout.count("training on ") == 1, run.output()
    assert "training on 2 rank(s) from epoch 0" in run.stdout and "reset:" not in run.stdout, run.output()
    assert sorted(run.losses()) == [0, 1, 2], run.output()
    assert_falls(run.losses(), run)
    assert "done: 3 epoch(s) trained, ending on 2 rank(s)" in run.stdout, run.output()


# -- sharded store and compression -----------------------------------------------------------------

def test_sharded_store(workdir):
    run = run_example(SHARDED_STORE, workdir)
    assert "sharded_store: 2 rank(s), table of 20000 x 16" in run.stdout, run.output()
    assert sorted(run.losses()) == [0, 1], run.output()
    assert_falls(run.losses(), run)
    saved = workdir / "checkpoints" / "sharded_store"
    assert (saved / "ckpt-epoch-000001.h5").is_file(), run.output()
    shards = sorted(p.name for p in (saved / "store-epoch-000001").glob("items.*.h5"))
    assert shards == ["items.00000-of-00002.h5", "items.00001-of-00002.h5"], "each rank wrote its shard"


@pytest.mark.parametrize("name, least_ratio", [("topk", 20.0), ("powersgd", 4.0)])
def test_compression(workdir, name, least_ratio):
    run = run_example(COMPRESSION[name], workdir)
    losses = run.losses(STEP_LINE)
    assert sorted(losses) == [10, 20, 30], run.output()
    assert_falls(losses, run)
    sent = re.search(rf"{name}: (\d+) exchanges, .*: ([0-9.]+)x fewer", run.stdout)
    assert sent and float(sent.group(2)) >= least_ratio, f"compressed less than {least_ratio}x\n{run.output()}"


# -- no launch ---------------------------------------------------------------------------------------

@pytest.mark.unit
def test_every_command_is_run_by_one_test():
    assert sorted(TESTED) == sorted(EXAMPLE_COMMANDS)


@pytest.mark.unit
def test_every_example_is_launched_and_listed_in_the_readme():
    readme = (EXAMPLES_DIR / "README.md").read_text()
    scripts = sorted(p.name for p in EXAMPLES_DIR.glob("*.py"))
    assert scripts, "examples/ has no scripts"
    for name in scripts + ["discover_hosts.sh"]:
        assert any(f"examples/{name}" in c for c in EXAMPLE_COMMANDS), f"no command launches examples/{name}"
        assert f"examples/{name}" in readme or f"({name})" in readme, f"examples/README.md does not list {name}"
    for text in EXAMPLE_COMMANDS:
        assert f"`{text}`" in readme, f"examples/README.md does not give the command {text!r}"
    assert os.access(EXAMPLES_DIR / "discover_hosts.sh", os.X_OK), "hvpsrun runs the discovery script directly"


@pytest.mark.unit
@pytest.mark.parametrize("script", sorted(p.name for p in EXAMPLES_DIR.glob("*.py")))
def test_every_flag_has_help_and_the_module_says_how_to_launch_it(script):
    tree = ast.parse((EXAMPLES_DIR / script).read_text())
    docstring = ast.get_docstring(tree) or ""
    assert f"examples/{script}" in docstring, f"{script}'s docstring gives no launch command"
    flags = [node for node in ast.walk(tree)
             if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"]
    assert flags, f"{script} takes no flags"
    for node in flags:
        name = node.args[0].value if node.args and isinstance(node.args[0], ast.Constant) else "?"
        assert any(k.arg == "help" for k in node.keywords), f"{script}: flag {name} has no help text"
