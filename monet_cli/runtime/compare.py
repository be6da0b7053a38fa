"""Run a schedule for real next to the unmodified model and measure both.

Same weights (seeded build), same data, same RNG stream per step. Peak memory is read
with the profiler's meter; step time is the median of plain, unmetered steps,
interleaved between the two models.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch

from monet_cli.core.schedule import Schedule
from monet_cli.runtime.executor import apply_schedule
from monet_cli.workload.step import Workload, build_workload, run_checked

CHECK_SEED = 1234
RTOL, ATOL = 1e-5, 1e-6


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    grads_match: bool
    params_match: bool
    buffers_match: bool
    max_grad_diff: float

    @property
    def ok(self) -> bool:
        return self.grads_match and self.params_match and self.buffers_match


@dataclass(frozen=True, kw_only=True, slots=True)
class ApplyReport:
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    baseline_peak_bytes: int
    step_ms: float
    baseline_step_ms: float
    check: CheckResult | None
    meter: str
    timeline: tuple[int, ...] = ()
    """Measured live bytes after each op of the scheduled step (CPU, when asked for)."""
    baseline_timeline: tuple[int, ...] = ()

    @property
    def within_budget(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def prediction_error(self) -> float:
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / max(1, self.measured_peak_bytes)


def _first_step(workload: Workload) -> dict[str, dict[str, torch.Tensor]]:
    """One seeded step; returns grads (before the update), params and buffers (after)."""
    grads: dict[str, torch.Tensor] = {}

    def snapshot_grads(phase: str, loss: torch.Tensor) -> None:
        if phase == "optimizer":
            grads.update(
                (n, p.grad.detach().clone()) for n, p in workload.model.named_parameters() if p.grad is not None
            )

    torch.manual_seed(CHECK_SEED)
    workload.zero_grad()
    workload.step(on_phase=snapshot_grads)
    return {
        "grads": grads,
        "params": {n: p.detach().clone() for n, p in workload.model.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in workload.model.named_buffers()},
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[bool, float]:
    if a.keys() != b.keys():
        return False, float("inf")
    worst, ok = 0.0, True
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape:
            return False, float("inf")
        if x.is_floating_point():
            worst = max(worst, float((x - y).abs().max()) if x.numel() else 0.0)
            ok = ok and torch.allclose(x, y, rtol=RTOL, atol=ATOL)
        else:
            ok = ok and torch.equal(x, y)
    return ok, worst


def compare(baseline: dict, scheduled: dict) -> CheckResult:
    grads_ok, grad_diff = _same(baseline["grads"], scheduled["grads"])
    params_ok, _ = _same(baseline["params"], scheduled["params"])
    buffers_ok, _ = _same(baseline["buffers"], scheduled["buffers"])
    return CheckResult(grads_match=grads_ok, params_match=params_ok, buffers_match=buffers_ok, max_grad_diff=grad_diff)


def run_apply(
    schedule: Schedule, device: torch.device, *, steps: int, check: bool,
    progress: Callable[[str], None] = lambda label: None, timeline: bool = False,
) -> ApplyReport:
    spec = schedule.model
    progress("building models")
    baseline = run_checked(lambda: build_workload(spec, device, prepare=False), "building the baseline")
    scheduled = run_checked(lambda: build_workload(spec, device), "building the scheduled model")
    apply_schedule(scheduled.model, schedule)
    progress("first step (fingerprint check)")
    first_base = run_checked(lambda: _first_step(baseline), "baseline step")
    first_sched = run_checked(lambda: _first_step(scheduled), "scheduled step")
    result = compare(first_base, first_sched) if check else None
    progress("measuring peak memory")
    base_peak = run_checked(lambda: baseline.measure_peak(CHECK_SEED + 1, timeline=timeline), "baseline step")
    sched_peak = run_checked(lambda: scheduled.measure_peak(CHECK_SEED + 1, timeline=timeline), "scheduled step")
    base_ms, sched_ms = [], []
    for i in range(steps):
        progress(f"timing steps ({i + 1}/{steps})")
        seed = CHECK_SEED + 2 + i
        base_ms.append(run_checked(lambda: baseline.timed_step(seed), "baseline step"))  # noqa: B023 (called now)
        sched_ms.append(run_checked(lambda: scheduled.timed_step(seed), "scheduled step"))  # noqa: B023
    return ApplyReport(
        budget_bytes=schedule.budget_bytes,
        predicted_peak_bytes=schedule.predicted.peak_bytes,
        measured_peak_bytes=sched_peak.peak_bytes,
        baseline_peak_bytes=base_peak.peak_bytes,
        step_ms=round(statistics.median(sched_ms), 3),
        baseline_step_ms=round(statistics.median(base_ms), 3),
        check=result,
        meter=sched_peak.meter,
        timeline=sched_peak.timeline,
        baseline_timeline=base_peak.timeline,
    )
