"""The autotuner's search on its own, driven by step times that depend on the setting."""

import pytest

from hvps.core.errors import HvpsError
from hvps.core.settings import Settings
from hvps.runtime.autotune import CYCLES_MS, THRESHOLDS, Autotuner, MiB, Setting

pytestmark = pytest.mark.unit


def _drive(tuner: Autotuner, step_time, steps: int = 200) -> list:
    """Run ``steps`` steps whose duration is ``step_time(setting in force)``; returns the settings applied."""
    applied = [tuner.first()]
    now = 0.0
    tuner.step(now)
    for _ in range(steps):
        now += step_time(applied[-1])
        new = tuner.step(now)
        if new is not None:
            applied.append(new)
    return applied


def test_coordinate_search_finds_the_fastest_setting():
    def step_time(s: Setting) -> float:  # fastest at 16 MiB, then at a 2.5 ms cycle
        return 1.0 + abs(s.fusion_threshold - 16 * MiB) / MiB * 0.01 + abs(s.cycle_time_ms - 2.5) * 0.02

    tuner = Autotuner(Setting(64 * MiB, 1.0), warmup=2, steps_per_sample=3)
    applied = _drive(tuner, step_time)
    assert tuner.done and tuner.chosen == Setting(16 * MiB, 2.5)
    assert applied[-1] == tuner.chosen
    assert [s.fusion_threshold for s in applied[:len(THRESHOLDS)]] == list(THRESHOLDS)
    assert {s.cycle_time_ms for s in applied[len(THRESHOLDS):-1]} == set(CYCLES_MS) - {1.0}
    report = tuner.report()
    assert report["chosen"] == {"fusion_threshold": 16 * MiB, "cycle_time_ms": 2.5}
    assert len(report["samples"]) == len(THRESHOLDS) + len(CYCLES_MS) - 1
    assert all(s["steps"] == 3 for s in report["samples"])


def test_warmup_steps_are_not_timed():
    """A slow first step after each switch (warm-up) must not count against that setting."""
    slow_after_switch = {"n": 0}
    tuner = Autotuner(Setting(64 * MiB, 1.0), warmup=1, steps_per_sample=2, thresholds=(1 * MiB, 4 * MiB),
                      cycles_ms=(1.0,))
    applied = [tuner.first()]
    now = 0.0
    tuner.step(now)
    while not tuner.done:
        # the step right after a switch takes 100 s; otherwise 1 MiB is slower (2 s) than 4 MiB (1 s)
        slow_after_switch["n"] += 1
        duration = 100.0 if slow_after_switch["n"] == 1 else (2.0 if applied[-1].fusion_threshold == MiB else 1.0)
        now += duration
        new = tuner.step(now)
        if new is not None:
            applied.append(new)
            slow_after_switch["n"] = 0
    assert tuner.chosen == Setting(4 * MiB, 1.0)
    assert max(s["median_step_s"] for s in tuner.report()["samples"]) == 2.0


def test_nothing_changes_after_the_choice():
    tuner = Autotuner(Setting(64 * MiB, 1.0), warmup=0, steps_per_sample=1, thresholds=(MiB,), cycles_ms=(1.0,))
    applied = _drive(tuner, lambda s: 1.0, steps=20)
    assert tuner.done and applied == [Setting(MiB, 1.0), Setting(MiB, 1.0)]


def test_bad_parameters():
    with pytest.raises(ValueError):
        Autotuner(Setting(MiB, 1.0), steps_per_sample=0)


def test_settings_from_environment(monkeypatch):
    monkeypatch.setenv("HVPS_AUTOTUNE", "1")
    monkeypatch.setenv("HVPS_AUTOTUNE_STEPS_PER_SAMPLE", "7")
    settings = Settings.from_env()
    assert settings.autotune and settings.autotune_steps_per_sample == 7 and settings.autotune_warmup_steps == 2
    monkeypatch.setenv("HVPS_AUTOTUNE", "yes")
    with pytest.raises(HvpsError, match="HVPS_AUTOTUNE"):
        Settings.from_env()
