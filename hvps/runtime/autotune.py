"""Online tuning of the fusion threshold and the cycle time from measured step times (``HVPS_AUTOTUNE=1``).

The best fusion threshold and cycle time depend on the model, the network and the rank count,
so hvps can try them during the first steps of a run instead of asking the user to. Rank 0 runs
the search (it decides fusion) and sends each setting to the other ranks with its responses.

The search is a coordinate search, not Horovod's Bayesian optimisation: first every fusion
threshold at the default cycle time, then every cycle time at the best threshold; the setting
with the lowest median step time wins and stays for the rest of the run. Each setting is held for
``warmup`` steps (discarded: fusion patterns settle) and then ``steps_per_sample`` timed steps.
A step is what the framework adapters report once per optimizer step (``synchronize``).
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Optional

log = logging.getLogger("hvps")

MiB = 1 << 20
#: fusion thresholds tried, bytes
THRESHOLDS = (1 * MiB, 4 * MiB, 16 * MiB, 64 * MiB, 128 * MiB)
#: cycle times tried, milliseconds
CYCLES_MS = (0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class Setting:
    """One point of the search."""

    fusion_threshold: int
    cycle_time_ms: float

    def describe(self) -> str:
        return f"fusion threshold {self.fusion_threshold / MiB:g} MiB, cycle time {self.cycle_time_ms:g} ms"


@dataclass
class _Sample:
    setting: Setting
    step_seconds: list = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.step_seconds)


class Autotuner:
    """Chooses a :class:`Setting` from step times; feed it ``step(now)`` once per training step."""

    def __init__(self, start: Setting, warmup: int = 2, steps_per_sample: int = 5,
                 thresholds: tuple = THRESHOLDS, cycles_ms: tuple = CYCLES_MS) -> None:
        if steps_per_sample < 1 or warmup < 0:
            raise ValueError("autotune needs steps_per_sample >= 1 and warmup >= 0")
        self.start, self.warmup, self.steps_per_sample = start, warmup, steps_per_sample
        self._cycles_ms = cycles_ms
        self._queue = [Setting(t, start.cycle_time_ms) for t in thresholds]
        self._samples: list[_Sample] = []
        self._cycle_phase = False
        self._last: Optional[float] = None
        self._skip = 0
        self.chosen: Optional[Setting] = None

    @property
    def done(self) -> bool:
        return self.chosen is not None

    def first(self) -> Setting:
        """The setting to apply before the first step."""
        self._next_sample()
        return self._samples[-1].setting

    def step(self, now: float) -> Optional[Setting]:
        """Note a step that ended at ``now`` (seconds, monotonic); returns a setting to apply, if it changes."""
        last, self._last = self._last, now
        if self.done or last is None or not self._samples:
            return None
        if self._skip > 0:
            self._skip -= 1
            return None
        sample = self._samples[-1]
        sample.step_seconds.append(now - last)
        if len(sample.step_seconds) < self.steps_per_sample:
            return None
        if not self._queue and not self._cycle_phase:
            self._cycle_phase = True
            best = min(self._samples, key=lambda s: s.median).setting
            self._queue = [Setting(best.fusion_threshold, c) for c in self._cycles_ms if c != best.cycle_time_ms]
        if self._queue:
            self._next_sample()
            return self._samples[-1].setting
        best = min(self._samples, key=lambda s: s.median)
        self.chosen = best.setting
        log.warning("hvps autotune: chose %s (median step %.4f s; %d settings tried, %d steps each)",
                    self.chosen.describe(), best.median, len(self._samples), self.steps_per_sample)
        return self.chosen

    def _next_sample(self) -> None:
        self._samples.append(_Sample(self._queue.pop(0)))
        self._skip = self.warmup

    def report(self) -> dict:
        """What was tried and chosen (JSON-ready), for logs and benchmark output."""
        return {"done": self.done,
                "chosen": None if self.chosen is None else {"fusion_threshold": self.chosen.fusion_threshold,
                                                           "cycle_time_ms": self.chosen.cycle_time_ms},
                "warmup_steps": self.warmup, "steps_per_sample": self.steps_per_sample,
                "samples": [{"fusion_threshold": s.setting.fusion_threshold,
                             "cycle_time_ms": s.setting.cycle_time_ms,
                             "median_step_s": s.median if s.step_seconds else None,
                             "steps": len(s.step_seconds)} for s in self._samples]}
