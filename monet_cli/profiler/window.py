"""The profile's times taken again in the window where a schedule's steps are measured.

This 2-core CPU changes speed within minutes, and not evenly over a step (``retimed``): a
tiny_gpt profile takes its walls, its step and its checkpoint prices at one speed, and a
measurement that follows may run at another. Six gpt profiles in a row (12-05) predicted
checkpointing every block at +45% to +53%, where the step measured +48% to +54%.

So each repeat of a measurement (``monet apply``'s timed pairs, the bench's rounds) also runs
one step of the profile's workload (monet's preparation, no schedule) with its module calls
timed (``CallTimer``, as ``monet profile`` times them). ``in_window`` puts those times into the
profile, with the model as written (the measurement's unmodified step) paired with them repeat
by repeat where monet's preparation changes it: each plan is predicted again from them, its
step and walls timed where its overhead is measured (the checkpoint machinery's prices only
scaled: they take too long to time again).
"""

from __future__ import annotations

import statistics
from dataclasses import replace

from monet_cli.core.profile import Profile
from monet_cli.profiler.capture import CallTimer, Timings, retimed
from monet_cli.workload.step import Workload


class WindowTimer:
    """One timed step per repeat of the profile's workload: its step time and its calls' forwards."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.timings = Timings()
        self.as_written_ms: list[float] = []
        self.workload: Workload | None = None

    def start(self, workload: Workload) -> None:
        """Time ``workload`` (built as the profile's) from now on, after one untimed step."""
        self.workload = workload
        workload.timed_step(seed=0)

    def tick(self, as_written_ms: float) -> None:
        """One timed step; ``as_written_ms``: the unmodified step's time in the same repeat."""
        assert self.workload is not None, "start() first"
        step_ms, call_ms = CallTimer(self.workload).step()
        self.timings.step_ms.append(step_ms)
        self.timings.call_ms.append(call_ms)
        self.as_written_ms.append(as_written_ms)

    def in_window(self) -> Profile:
        """The profile in the window's times."""
        assert self.workload is not None, "start() first"
        return in_window(self.profile, self.timings, self.as_written_ms if self.workload.out_of_place else None)


def in_window(profile: Profile, timings: Timings, as_written_ms: list[float] | None = None) -> Profile:
    """``profile`` in the time of ``timings`` (``retimed``), with the model as written at the
    median of ``as_written_ms`` over ``timings``' steps, paired, where given: a step too slow
    for the profile to pair gets one too."""
    window = retimed(profile, timings)
    if as_written_ms is None:
        return window
    step_ms = window.baseline.step_ms
    as_written = step_ms * statistics.median(a / p for a, p in zip(as_written_ms, timings.step_ms, strict=True))
    return replace(window, baseline=replace(window.baseline, as_written_step_ms=as_written))
