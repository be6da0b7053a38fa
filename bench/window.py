"""The profile's times taken again in the window where the bench measures its methods.

This 2-core CPU runs at two speeds and changes between them within minutes. Its slow speed
does not slow a step evenly: on tiny_gpt (six profiles in a row, 12-05) a step of 77 ms
against 64 ran the backward 35% slower and the forward 13%. So the overhead of a plan moves
with the speed (checkpointing every block: +52% measured at the fast speed, +48% at the
slow), and so does the overhead a profile predicts (+51 to +53% from profiles taken fast,
+45 to +50% from profiles taken slow). A profile taken at one speed and a bench measured at
the other disagree by up to 9 points on that plan, whatever the time model.

So each repeat of the bench also runs one step of the prepared model with its module calls
timed (``CallTimer``, as ``monet profile`` times them), in the same rotation as the methods.
``in_window`` puts those times into the profile: each plan is predicted again from them, the
time model checked with its inputs timed where its outputs are measured.
"""

from __future__ import annotations

import dataclasses
from dataclasses import replace

from monet_cli.core.profile import Profile
from monet_cli.profiler.capture import CallTimer, Timings
from monet_cli.workload.step import Workload

NAME = "profile timing"
"""The timer's place in the bench's rotation."""


class WindowTimer:
    """One timed step per repeat of a prepared workload: its step time and its calls' forwards."""

    def __init__(self, workload: Workload, profile: Profile) -> None:
        self.workload = workload
        self.profile = profile
        self.timings = Timings()

    def tick(self) -> None:
        step_ms, call_ms = CallTimer(self.workload).step()
        if len(call_ms) != len(self.profile.calls):
            raise RuntimeError("the model made other module calls than when it was profiled")
        self.timings.step_ms.append(step_ms)
        self.timings.call_ms.append(call_ms)

    def in_window(self) -> Profile:
        return in_window(self.profile, self.timings)


def in_window(profile: Profile, timings: Timings) -> Profile:
    """``profile`` with its step and its calls' wall times replaced by the medians of
    ``timings``, and every other price it holds in ms (the checkpoint machinery, the model as
    written, operator variants) scaled by the window's step over the profile's: those take too
    long to time again in every repeat."""
    step_ms = timings.median_step_ms()
    speed = step_ms / profile.baseline.step_ms
    call_ms = timings.median_call_ms([call.parent for call in profile.calls])
    baseline = profile.baseline
    as_written = baseline.as_written_step_ms
    return replace(
        profile,
        baseline=replace(
            baseline, step_ms=step_ms, as_written_step_ms=None if as_written is None else as_written * speed
        ),
        calls=tuple(
            replace(call, time_ms=None if call.time_ms is None else call_ms[call.index]) for call in profile.calls
        ),
        overheads=replace(
            profile.overheads,
            **{
                field.name: value * speed
                for field in dataclasses.fields(profile.overheads)
                if field.name.endswith("_ms") and (value := getattr(profile.overheads, field.name)) is not None
            },
        ),
        variants=tuple(replace(v, time_ms=v.time_ms * speed) for v in profile.variants),
    )
