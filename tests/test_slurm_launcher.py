"""Which launcher hvpsrun takes inside a Slurm allocation: the pmix probe's decision as pure
functions, with the probe's commands answered by an injected runner (no Slurm started here;
tests/test_slurm.py runs the same probe against real daemons)."""

from __future__ import annotations

import os
import subprocess

import pytest

from hvps.runner.launch import choose_launcher
from hvps.runner.settings import parse_args
from hvps.runner.slurm_command import (
    PMIX_PROBE_STEP,
    PmixProbe,
    decide_slurm_launcher,
    listed_mpi_plugins,
    probe_pmix,
    srun_failure,
)

pytestmark = pytest.mark.unit

LIST_22_05 = "MPI plugin types are...\n\tpmix\n\tnone\n\tcray_shasta\n\tpmi2\nspecific pmix plugin versions " \
             "available: pmix_v4\n"
LIST_OLD = "srun: MPI types are...\nsrun: none\nsrun: pmix_v3\nsrun: pmix\nsrun: pmi2\n"
LIST_NO_PMIX = "MPI plugin types are...\n\tnone\n\tpmi2\n"
# what Debian's srun prints when slurm-wlm's pmix plugin cannot find libpmix (measured on slurm 22.05.8)
DEBIAN_NO_LIBPMIX = (
    "srun: error:  mpi/pmix_v4: init: (null) [0]: mpi_pmix.c:195: pmi/pmix: can not load PMIx library\n"
    "srun: error: Couldn't load specified plugin name for mpi/pmix: Plugin init() callback failed\n"
    "srun: error: MPI: Cannot create context for mpi/pmix\n"
    "srun: error: MPI: Unable to load any plugin\n"
    "srun: error: Invalid MPI type 'pmix', --mpi=list for acceptable types\n")


class FakeSrun:
    """Answers the probe's two commands (``--mpi=list``, then the step) and records the calls."""

    def __init__(self, listing=(0, LIST_22_05, ""), step=(0, "0\n", "")):
        self.answers = {"--mpi=list": listing, "--mpi=pmix": step}
        self.calls = []

    def __call__(self, argv, **kwargs):
        self.calls.append((list(argv), kwargs))
        answer = self.answers[argv[1]]
        if isinstance(answer, BaseException):
            raise answer
        rc, out, err = answer
        return subprocess.CompletedProcess(argv, rc, out, err)


@pytest.fixture
def slurm_env(tmp_path):
    """An allocation's environment whose PATH holds an (unused) executable named srun."""
    srun = tmp_path / "srun"
    srun.write_text("#!/bin/sh\nexit 99\n")
    srun.chmod(0o755)
    return {"SLURM_JOB_ID": "12", "SLURM_NTASKS": "2", "PATH": str(tmp_path)}


def test_listed_plugins_current_and_old_formats():
    assert listed_mpi_plugins(LIST_22_05) == ("pmix", "none", "cray_shasta", "pmi2")
    assert listed_mpi_plugins(LIST_OLD) == ("none", "pmix_v3", "pmix", "pmi2")


def test_failure_line_is_the_plugin_error():
    assert srun_failure(DEBIAN_NO_LIBPMIX, 1) == \
        "Couldn't load specified plugin name for mpi/pmix: Plugin init() callback failed"
    assert srun_failure("srun: fatal: Could not establish a configuration source\n", 1) == \
        "Could not establish a configuration source"
    assert srun_failure("", 7) == "exit status 7"


def test_usable_when_listed_and_the_step_gets_a_pmix_rank(slurm_env):
    run = FakeSrun()
    result = probe_pmix(slurm_env, run=run, timeout=5)
    assert result.usable, result
    (list_argv, list_kw), (step_argv, step_kw) = run.calls
    srun = os.path.join(slurm_env["PATH"], "srun")
    assert list_argv == [srun, "--mpi=list"]
    assert step_argv == [srun, *PMIX_PROBE_STEP]
    assert step_argv[1:] == ["--mpi=pmix", "-N1", "-n1", "--quiet", "printenv", "PMIX_RANK"]
    for kw in (list_kw, step_kw):
        assert kw["timeout"] == 5 and kw["stdin"] is subprocess.DEVNULL and kw["env"] == slurm_env


def test_plugin_listed_but_init_fails(slurm_env):
    """Debian's slurm-wlm lists pmix although libpmix is absent: only the step shows it."""
    result = probe_pmix(slurm_env, run=FakeSrun(step=(1, "", DEBIAN_NO_LIBPMIX)))
    assert result == PmixProbe(False, "a probe step failed: Couldn't load specified plugin name for mpi/pmix: "
                                      "Plugin init() callback failed")


def test_not_listed_skips_the_step(slurm_env):
    run = FakeSrun(listing=(0, LIST_NO_PMIX, ""))
    result = probe_pmix(slurm_env, run=run)
    assert result == PmixProbe(False, "srun --mpi=list does not list pmix (it lists: none, pmi2)")
    assert len(run.calls) == 1


def test_listing_fails(slurm_env):
    result = probe_pmix(slurm_env, run=FakeSrun(listing=(1, "", "srun: fatal: Could not establish a "
                                                                    "configuration source\n")))
    assert result == PmixProbe(False, "srun --mpi=list failed: Could not establish a configuration source")


def test_step_without_pmix_environment(slurm_env):
    """printenv exits 1 with no output when the plugin set no PMIX_RANK."""
    result = probe_pmix(slurm_env, run=FakeSrun(step=(1, "", "")))
    assert not result.usable and "PMIX_RANK unset" in result.reason


def test_step_times_out(slurm_env):
    run = FakeSrun(step=subprocess.TimeoutExpired(["/x/srun", *PMIX_PROBE_STEP], 5))
    result = probe_pmix(slurm_env, run=run, timeout=5)
    assert result == PmixProbe(False, "'srun --mpi=pmix -N1 -n1 --quiet printenv PMIX_RANK' did not finish "
                                      "within 5 s")


def test_no_srun_on_path(tmp_path):
    run = FakeSrun()
    assert probe_pmix({"SLURM_JOB_ID": "3", "PATH": str(tmp_path)}, run=run) == \
        PmixProbe(False, "srun is not on PATH")
    assert run.calls == []


def test_decision_lines():
    env = {"SLURM_JOB_ID": "12"}
    good, bad = PmixProbe(True, "it works"), PmixProbe(False, "no libpmix")
    assert decide_slurm_launcher("auto", env, lambda e: good) == ("srun", "Slurm job 12: srun --mpi=pmix (it works)")
    assert decide_slurm_launcher("auto", env, lambda e: bad) == (
        "mpirun", "Slurm job 12: srun's pmix plugin is unusable here (no libpmix); launching with mpirun inside "
                  "the allocation")


@pytest.mark.parametrize("forced", ["srun", "mpirun"])
def test_forced_launcher_is_not_probed(forced):
    def probe(env):
        raise AssertionError("probed although --launcher was given")

    launcher, line = decide_slurm_launcher(forced, {"SLURM_JOB_ID": "5"}, probe)
    assert launcher == forced and line.startswith("Slurm job 5: ") and f"--launcher {forced}" in line


def test_choose_launcher_logs_the_decision_inside_slurm(capsys):
    settings = parse_args(["-np", "2", "python", "train.py"])
    probed = []

    def probe(env):
        probed.append(env["SLURM_JOB_ID"])
        return PmixProbe(False, "no libpmix")

    assert choose_launcher(settings, {"SLURM_JOB_ID": "9"}, probe=probe) == "mpirun"
    assert probed == ["9"]
    assert capsys.readouterr().err.splitlines() == [
        "hvpsrun: Slurm job 9: srun's pmix plugin is unusable here (no libpmix); launching with mpirun inside the "
        "allocation"]
    assert choose_launcher(settings, {"SLURM_JOB_ID": "9"}, probe=lambda env: PmixProbe(True, "ok")) == "srun"


def test_choose_launcher_outside_slurm_never_probes(capsys):
    def probe(env):
        raise AssertionError("probed outside Slurm")

    assert choose_launcher(parse_args(["python", "t.py"]), {}, probe=probe) == "mpirun"
    assert choose_launcher(parse_args(["--launcher", "srun", "python", "t.py"]), {}, probe=probe) == "srun"
    assert capsys.readouterr().err == ""
