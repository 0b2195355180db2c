"""Every code block of README.md and docs/**/*.md runs in this test, or is checked another way (issue 40).

A block's kind comes from an HTML comment on the line before its fence (invisible in the rendered page):

* none: the block runs. ``python`` blocks run as one process of their own would run them (``hvd.init()``
  without a launcher is a job of one rank), each in fresh globals; ``bash`` blocks run under ``bash -e``.
  The blocks of one page share a working directory, in page order for each language (the python blocks
  of every page first, then the shell blocks), which holds ``train.py`` (the README's first job) and links
  to ``benchmarks/``, ``examples/`` and ``jobs/``.
* ``<!-- snippet: example -->``: each command line must be one that the examples' test runs
  (``tests/examples_commands.py``), so the docs cannot show a command that CI does not run.
* ``<!-- snippet: not-run (reason) -->``: a reason is required; the block is still parsed (python:
  ``compile``; bash: ``bash -n``; yaml: ``yaml.safe_load``). The test reports how many there are.
* ``<!-- snippet: layout -->`` (a ``text`` block): every directory it names exists.
* ``<!-- snippet: slurm -->`` (a ``bash`` batch file with ``#SBATCH`` lines): parsed here (``bash -n``) and
  submitted by tests/test_slurm.py to its real Slurm cluster (:func:`slurm_batch_files`), sized down to it.
* ``<!-- snippet: file (NAME) -->`` (a ``python`` block): saved as ``NAME`` in its page's working directory,
  for a shell block of the same page to launch (``hvpsrun -np 4 python NAME``); that block must exist.

The python blocks run in two processes (PyTorch and numpy; TensorFlow), not one each, to keep the test
cheap; the same processes check that every public function and class of the API reference's modules has a
docstring. The strict build of the site (``mkdocs build --strict``) runs here too, when the ``docs`` extra is
installed.
"""

import json
import os
import re
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

from examples_commands import EXAMPLE_COMMANDS

ROOT = Path(__file__).resolve().parent.parent
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
ANNOTATION = re.compile(r"^<!-- snippet: (example|not-run|layout|file|slurm)(?: \((?P<reason>.+)\))? -->$")
FENCE = re.compile(r"^```(?P<lang>[\w-]*)\s*$")
RUNNABLE = {"python", "bash"}
CHECKABLE = {"python", "bash", "yaml"}
#: what the README's first job is saved as in every page's working directory
FIRST_JOB = "train.py"


@dataclass
class Block:
    """One fenced code block: where it is, its language, its code and how it is checked."""

    document: Path
    line: int
    lang: str
    code: str
    kind: str  # run, example, not-run, layout, file, slurm
    reason: Optional[str]  # not-run: why; file: the name it is saved as

    @property
    def where(self) -> str:
        return f"{self.document.relative_to(ROOT)}:{self.line}"


def read_blocks(document: Path) -> list:
    """The fenced blocks of ``document`` with the annotation on the line before each."""
    lines = document.read_text().split("\n")
    blocks, i = [], 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if not fence:
            i += 1
            continue
        start, previous = i, lines[i - 1].strip() if i else ""
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        assert end is not None, f"{document.relative_to(ROOT)}:{i + 1}: a code block is never closed"
        annotation = ANNOTATION.match(previous)
        kind = annotation.group(1) if annotation else "run"
        reason = annotation.group("reason") if annotation else None
        blocks.append(Block(document, start + 1, fence.group("lang"), "\n".join(lines[start + 1:end]) + "\n",
                            kind, reason))
        i = end + 1
    return blocks


BLOCKS = [block for document in DOCUMENTS for block in read_blocks(document)]


PYTHON = [b for b in BLOCKS if b.kind == "run" and b.lang == "python"]
SHELL = [b for b in BLOCKS if b.kind == "run" and b.lang == "bash"]


def first_job() -> Block:
    """The README's first job, which the pages' shell blocks run as train.py: its first python block that
    starts hvps (the one before it is a one-line import)."""
    return next(b for b in PYTHON if b.document.name == "README.md" and "hvd.init()" in b.code)


def slurm_batch_files() -> tuple:
    """The docs' Slurm batch files (``slurm`` blocks), with the README's first job that they run as train.py.

    Returns:
        ``[(where, batch file text)]`` and the first job's code, for tests/test_slurm.py to submit.
    """
    return [(b.where, b.code) for b in BLOCKS if b.kind == "slurm"], first_job().code


def needs_tensorflow(block: Block) -> bool:
    return "tensorflow" in block.code or "keras" in block.code


def test_every_block_has_a_language_and_a_known_kind():
    wrong = []
    for b in BLOCKS:
        if b.kind == "run" and b.lang not in RUNNABLE:
            wrong.append(f"{b.where}: a ```{b.lang} block must run (python, bash) or be annotated")
        elif b.kind == "not-run" and (not b.reason or b.lang not in CHECKABLE):
            wrong.append(f"{b.where}: not-run needs a reason and a language this test parses ({sorted(CHECKABLE)})")
        elif b.kind == "example" and b.lang != "bash":
            wrong.append(f"{b.where}: an example block is a bash block of command lines")
        elif b.kind == "layout" and b.lang != "text":
            wrong.append(f"{b.where}: a layout block is a text block")
        elif b.kind == "file" and (b.lang != "python" or not b.reason or "/" in b.reason or b.reason == FIRST_JOB):
            wrong.append(f"{b.where}: a file block is a python block with a plain file name other than {FIRST_JOB}")
        elif b.kind == "slurm" and (b.lang != "bash" or "#SBATCH" not in b.code):
            wrong.append(f"{b.where}: a slurm block is a bash batch file with #SBATCH lines")
    assert not wrong, "\n".join(wrong)


def command_lines(code: str) -> list:
    """The non-empty, non-comment lines of a shell block, with trailing comments and line continuations joined."""
    joined = code.replace("\\\n", " ")
    lines = [re.sub(r"\s+#.*$", "", line).strip() for line in joined.split("\n")]
    return [" ".join(line.split()) for line in lines if line and not line.startswith("#")]


@pytest.mark.unit
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "example"], ids=lambda b: b.where)
def test_an_example_block_shows_only_commands_the_examples_test_runs(block):
    known = {" ".join(command.split()) for command in EXAMPLE_COMMANDS}
    unknown = [line for line in command_lines(block.code) if line not in known]
    assert command_lines(block.code) and not unknown, (
        f"{block.where}: not in tests/examples_commands.py's EXAMPLE_COMMANDS: {unknown}")


@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind in ("not-run", "slurm")], ids=lambda b: b.where)
def test_a_block_that_cannot_run_still_parses(block):
    if block.lang == "python":
        compile(block.code, block.where, "exec")
    elif block.lang == "bash":
        proc = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
        assert proc.returncode == 0, f"{block.where}: {proc.stderr}"
    else:
        yaml = pytest.importorskip("yaml")
        yaml.safe_load(block.code)


@pytest.mark.unit
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "layout"], ids=lambda b: b.where)
def test_a_layout_block_names_directories_that_exist(block):
    missing, parent = [], ROOT
    for line in block.code.split("\n"):
        name = line.split(maxsplit=1)[0] if line.strip() else ""
        if not name.endswith("/"):
            continue
        if line.startswith(" "):
            path = parent / name
        else:
            path = parent = ROOT / name
        if not path.is_dir():
            missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"{block.where}: the layout names directories that do not exist: {missing}"


@pytest.mark.unit
@pytest.mark.parametrize("block", [b for b in BLOCKS if b.kind == "file"], ids=lambda b: b.where)
def test_a_saved_program_is_launched_by_a_shell_block_of_its_page(block):
    compile(block.code, block.where, "exec")
    launched = [b for b in SHELL if b.document == block.document
                and any(f"python {block.reason}" in line for line in command_lines(b.code))]
    assert launched, f"{block.where}: no shell block of the page runs 'python {block.reason}'"


#: executes the snippets given in a JSON file, each in fresh globals in its page's directory, and writes
#: one result per snippet; hvps is shut down and the environment restored between snippets
RUNNER = textwrap.dedent("""
    import json, os, sys, traceback
    snippets = json.load(open(sys.argv[1]))
    results = {}
    for snippet in snippets:
        if "modules" in snippet:  # the API reference's public functions and classes, as imported
            import importlib, inspect
            results[snippet["where"]] = [
                f"{name}.{attr}" for name in snippet["modules"] for attr in importlib.import_module(name).__all__
                if (inspect.isfunction(obj := getattr(importlib.import_module(name), attr))
                    or inspect.isclass(obj)) and not obj.__doc__]
            continue
        environment = dict(os.environ)
        os.chdir(snippet["cwd"])
        print(f"=== {snippet['where']}", flush=True)
        try:
            exec(compile(snippet["code"], snippet["where"], "exec"), {"__name__": "__main__"})
            results[snippet["where"]] = None
        except BaseException:
            results[snippet["where"]] = traceback.format_exc()
        finally:
            sys.stdout.flush()
            if "hvps" in sys.modules:
                import hvps
                if hvps.is_initialized():
                    hvps.shutdown()
            os.environ.clear()
            os.environ.update(environment)
    json.dump(results, open(sys.argv[2], "w"))
""")


def environment() -> dict:
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")
    env["TF_CPP_MIN_LOG_LEVEL"] = "2"
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    if os.geteuid() == 0:
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    return env


@pytest.fixture(scope="module")
def page_directories(tmp_path_factory) -> dict:
    """A working directory per page, holding the README's first job as train.py and links to the tree."""
    job = first_job()
    directories = {}
    for document in DOCUMENTS:
        folder = tmp_path_factory.mktemp(document.stem)
        (folder / FIRST_JOB).write_text(job.code)
        for block in BLOCKS:
            if block.kind == "file" and block.document == document:
                (folder / block.reason).write_text(block.code)
        for name in ("benchmarks", "examples", "jobs"):
            (folder / name).symlink_to(ROOT / name)
        directories[document] = folder
    return directories


@pytest.fixture(scope="module")
def python_results(page_directories, tmp_path_factory) -> dict:
    """Runs every python block, in two processes (TensorFlow's blocks apart); ``{where: None or traceback}``."""
    results, work = {}, tmp_path_factory.mktemp("runner")
    for group, blocks in (("torch", [b for b in PYTHON if not needs_tensorflow(b)]),
                          ("tensorflow", [b for b in PYTHON if needs_tensorflow(b)])):
        if group == "tensorflow":
            try:
                import tensorflow  # noqa: F401
            except ImportError:
                results.update({b.where: "skip: TensorFlow is not installed (the tensorflow extra)"
                                for b in blocks})
                results[f"docstrings of {group}"] = "skip: TensorFlow is not installed (the tensorflow extra)"
                continue
        snippets = work / f"{group}.json"
        out = work / f"{group}-results.json"
        snippets.write_text(json.dumps([{"where": b.where, "code": b.code, "cwd": str(page_directories[b.document])}
                                        for b in blocks]
                                       + [{"where": f"docstrings of {group}", "modules": API_MODULES[group]}]))
        proc = subprocess.run([sys.executable, "-c", RUNNER, str(snippets), str(out)], env=environment(),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0 and out.exists(), f"the {group} runner failed:\n{proc.stdout}\n{proc.stderr}"
        results.update(json.loads(out.read_text()))
    return results


@pytest.mark.parametrize("block", PYTHON, ids=lambda b: b.where)
def test_a_python_block_runs(block, python_results):
    outcome = python_results[block.where]
    if outcome and outcome.startswith("skip: "):
        pytest.skip(outcome[len("skip: "):])
    assert outcome is None, f"{block.where} failed:\n{outcome}"


@pytest.mark.parametrize("block", SHELL, ids=lambda b: b.where)
def test_a_shell_block_runs(block, page_directories, python_results):
    # python_results first: a page's shell blocks may read what its python blocks wrote (a checkpoint)
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", block.code], cwd=page_directories[block.document],
                          env=environment(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"{block.where} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    # a launch of the first job (not a --dry-run) trains on every rank: each prints its loss
    for line in command_lines(block.code):
        launch = re.search(r"-np (\d+) .*python " + re.escape(FIRST_JOB) + "$", line)
        if launch and "--dry-run" not in line:
            ranks = int(launch.group(1))
            found = sorted(map(int, re.findall(rf"rank (\d+) of {ranks}: loss", proc.stdout)))
            assert found == list(range(ranks)), f"{block.where}: {line!r} did not train on every rank:\n{proc.stdout}"


def test_report_the_snippet_counts(capsys):
    kinds = ("run", "file", "example", "slurm", "not-run", "layout")
    counts = {kind: sum(b.kind == kind for b in BLOCKS) for kind in kinds}
    with capsys.disabled():
        print(f"\ndocs snippets: {counts['run']} executed ({len(PYTHON)} python, {len(SHELL)} bash), "
              f"{counts['file']} saved and launched by one of them, "
              f"{counts['slurm']} Slurm batch files submitted by tests/test_slurm.py, "
              f"{counts['example']} example blocks checked against EXAMPLE_COMMANDS, {counts['not-run']} not run "
              f"(parsed only), {counts['layout']} layout blocks checked; {len(BLOCKS)} in all")
    assert counts["run"] >= 20, "the docs run fewer snippets than they did when this test was written"


#: the modules the API reference documents (docs/api/*.md), by the runner process that imports them
API_MODULES = {"torch": ["hvps", "hvps.adapters.torch", "hvps.checkpoint", "hvps.store", "hvps.elastic"],
               "tensorflow": ["hvps.adapters.tensorflow", "hvps.adapters.tensorflow.keras"]}


@pytest.mark.parametrize("group", sorted(API_MODULES))
def test_every_public_function_and_class_of_the_api_reference_has_a_docstring(group, python_results):
    outcome = python_results[f"docstrings of {group}"]
    if isinstance(outcome, str) and outcome.startswith("skip: "):
        pytest.skip(outcome[len("skip: "):])
    assert outcome == [], f"public names of the API reference without a docstring: {outcome}"


def test_the_site_builds_in_strict_mode(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra (mkdocs) is not installed")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, env={**environment(), "NO_MKDOCS_2_WARNING": "1"}, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stderr[-6000:]}"
