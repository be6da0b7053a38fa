"""Run a schedule for real next to the unmodified model and measure both.

Same weights (seeded build), same data, same RNG stream per step. Peak memory is read
with the profiler's meter; step time is the median of plain, unmetered steps,
interleaved between the two models. Where the caller passes a ``Window``, each pair is
followed by one step of the profile's workload with its calls timed, from which the schedule
is priced again at this run's speed.

The gradient check runs both first steps under deterministic algorithms and demands equal
bits. A model with an op that has no deterministic kernel on the device (some CUDA
backward ops use atomics) is checked again on fresh models within a tolerance per
precision, and the result says so. A schedule with operator variants states its own
tolerance (they are not bit-exact): gradients and parameters are compared within it,
BatchNorm running statistics still bit for bit.
"""

from __future__ import annotations

import contextlib
import statistics
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from monet_cli.core.plan import predicted_for
from monet_cli.core.profile import ModelSpec, Profile, other_speed
from monet_cli.core.schedule import Predicted, Schedule
from monet_cli.errors import FingerprintError, ModelError
from monet_cli.runtime.executor import apply_schedule, machinery
from monet_cli.runtime.host_memory import keep_freed_host_memory
from monet_cli.runtime.meter import measure_peak
from monet_cli.runtime.sharing import others_busy_since, read_cpu_times, warn_if_shared
from monet_cli.workload.step import Workload, build_workload, configure_cuda, in_place_activations, run_checked

CHECK_SEED = 1234
TOLERANCES = {"32": (1e-3, 1e-5), "bf16-mixed": (2e-2, 1e-3), "fp16-mixed": (2e-2, 1e-3)}
"""(rtol, atol) per precision, for models with an op that has no deterministic kernel: two
runs of it differ in the last bits (atomics), and mixed precision rounds those differences
to bfloat16 or float16 before they reach the float32 gradients."""


@dataclass(frozen=True, kw_only=True, slots=True)
class CheckResult:
    grads_match: bool
    params_match: bool
    buffers_match: bool
    max_grad_diff: float
    mode: str
    """``exact``: both steps ran with deterministic algorithms and must agree bit for bit;
    ``tolerance``: an op of the model has no deterministic kernel on this device, so values
    are compared within ``rtol``/``atol``; ``variants``: the schedule runs operator variants
    and states its tolerance (``atol`` relative to the largest gradient, buffers exact)."""
    rtol: float = 0.0
    atol: float = 0.0
    nondeterministic: str = ""
    """Why the check fell back to a tolerance: PyTorch's words about the op."""
    max_relative_diff: float = 0.0
    """The largest gradient difference over the largest gradient magnitude of the model."""
    variants: tuple[str, ...] = ()
    """Modules that ran an operator variant that is not bit-exact (``variants`` mode)."""

    @property
    def ok(self) -> bool:
        return self.grads_match and self.params_match and self.buffers_match

    def describe(self) -> str:
        if self.mode == "exact":
            return "bit-exact (deterministic algorithms)"
        if self.mode == "variants":
            return (
                f"within the variants' rtol {self.rtol:g}, atol {self.atol:g} x the largest gradient (largest "
                f"difference {self.max_relative_diff:.2g} of it; {len(self.variants)} variant sites not bit-exact)"
            )
        return f"within rtol {self.rtol:g}, atol {self.atol:g} (no deterministic kernel: {self.nondeterministic})"


@dataclass(frozen=True, kw_only=True, slots=True)
class ApplyReport:
    budget_bytes: int
    predicted_peak_bytes: int
    measured_peak_bytes: int
    baseline_peak_bytes: int
    step_ms: float
    baseline_step_ms: float
    predicted_overhead: float
    """The schedule's (``Predicted.overhead``), to set beside the measured ``overhead``."""
    profiled_baseline_step_ms: float
    """The unmodified step the prediction was priced at (``Predicted.baseline_step_ms``), to
    set beside the measured ``baseline_step_ms``."""
    paired_overheads: tuple[float, ...]
    """Each timed pair's scheduled step over its unmodified one, minus 1, in timing order."""
    check: CheckResult | None
    meter: str
    timeline: tuple[int, ...] = ()
    """Measured live bytes after each op of the scheduled step (CPU, when asked for)."""
    baseline_timeline: tuple[int, ...] = ()
    predicted_here: Predicted | None = None
    """The schedule predicted again from its profile's step and calls timed in this run's
    pairs (``monet_cli/profiler/window.py``); None where no window timed them (its profile
    was not at hand)."""

    @property
    def within_budget(self) -> bool:
        return self.measured_peak_bytes <= self.budget_bytes

    @property
    def overhead(self) -> float:
        """The median of the pairs' overheads: each pair's two steps ran back to back, so a
        change in the machine's speed between pairs moves both."""
        return statistics.median(self.paired_overheads)

    @property
    def overhead_range(self) -> tuple[float, float]:
        """The smallest and largest of the pairs' overheads: the noise the median sits in."""
        return min(self.paired_overheads), max(self.paired_overheads)

    @property
    def prediction_error(self) -> float:
        return (self.predicted_peak_bytes - self.measured_peak_bytes) / max(1, self.measured_peak_bytes)


def _first_step(workload: Workload) -> dict[str, dict[str, torch.Tensor]]:
    """One seeded step; returns grads (before the update), params and buffers (after), on the
    CPU so that they take no device memory while the peaks are measured."""
    grads: dict[str, torch.Tensor] = {}

    def snapshot_grads(phase: str, loss: torch.Tensor) -> None:
        if phase == "optimizer":
            grads.update(
                (n, p.grad.detach().cpu().clone()) for n, p in workload.model.named_parameters() if p.grad is not None
            )

    torch.manual_seed(CHECK_SEED)
    workload.zero_grad()
    workload.step(on_phase=snapshot_grads)
    return {
        "grads": grads,
        "params": {n: p.detach().cpu().clone() for n, p in workload.model.named_parameters()},
        "buffers": {n: b.detach().cpu().clone() for n, b in workload.model.named_buffers()},
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], rtol: float, atol: float) -> tuple[bool, float]:
    if a.keys() != b.keys():
        return False, float("inf")
    worst, ok = 0.0, True
    for name, x in a.items():
        y = b[name]
        if x.shape != y.shape:
            return False, float("inf")
        if x.is_floating_point():
            worst = max(worst, float((x - y).abs().max()) if x.numel() else 0.0)
            ok = ok and torch.allclose(x, y, rtol=rtol, atol=atol, equal_nan=True)
        else:
            ok = ok and torch.equal(x, y)
    return ok, worst


def compare(
    baseline: dict,
    scheduled: dict,
    *,
    mode: str = "exact",
    rtol: float = 0.0,
    atol: float = 0.0,
    nondeterministic: str = "",
    variants: tuple[str, ...] = (),
) -> CheckResult:
    """In ``variants`` mode ``atol`` is relative to the largest gradient magnitude, and
    buffers (BatchNorm statistics) must still be equal."""
    largest = max((float(g.abs().max()) for g in baseline["grads"].values() if g.numel()), default=0.0)
    absolute = atol * largest if mode == "variants" else atol
    grads_ok, grad_diff = _same(baseline["grads"], scheduled["grads"], rtol, absolute)
    params_ok, _ = _same(baseline["params"], scheduled["params"], rtol, absolute)
    exact_buffers = mode == "variants"
    buffers_ok, _ = _same(
        baseline["buffers"], scheduled["buffers"], 0.0 if exact_buffers else rtol, 0.0 if exact_buffers else atol
    )
    return CheckResult(
        grads_match=grads_ok,
        params_match=params_ok,
        buffers_match=buffers_ok,
        max_grad_diff=grad_diff,
        mode=mode,
        rtol=rtol,
        atol=atol,
        nondeterministic=nondeterministic,
        max_relative_diff=grad_diff / largest if largest else 0.0,
        variants=variants,
    )


class NoDeterministicKernel(ModelError):
    """An op of the model has no deterministic implementation on this device (caught below;
    a ``MonetError`` so that ``run_checked`` passes it through)."""


@contextlib.contextmanager
def deterministic_algorithms():
    """``torch.use_deterministic_algorithms(True)`` for the block, restored after it."""
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _run_first_step(workload: Workload, what: str) -> dict[str, dict[str, torch.Tensor]]:
    """``_first_step`` as user-model code; under deterministic algorithms, an op without a
    deterministic kernel raises ``NoDeterministicKernel``."""

    def step() -> dict[str, dict[str, torch.Tensor]]:
        try:
            return _first_step(workload)
        except RuntimeError as err:
            text = str(err).strip()
            if "use_deterministic_algorithms" not in text:
                raise
            raise NoDeterministicKernel(text.splitlines()[0].split(", but you set")[0]) from None

    return run_checked(step, what)


def _build_pair(schedule: Schedule, device: torch.device) -> tuple[Workload, Workload]:
    baseline = run_checked(lambda: build_workload(schedule.model, device, prepare=False), "building the baseline")
    scheduled = run_checked(lambda: build_workload(schedule.model, device), "building the scheduled model")
    apply_schedule(scheduled.model, schedule)
    return baseline, scheduled


def _checked_first_steps(schedule: Schedule, device: torch.device) -> tuple[Workload, Workload, CheckResult]:
    """The first step of both models compared: bit for bit under deterministic algorithms, or,
    where the model has an op without a deterministic kernel, on fresh models (the failed try
    may have updated BatchNorm statistics) within the precision's tolerance."""
    baseline, scheduled = _build_pair(schedule, device)
    try:
        with deterministic_algorithms():
            first_base = _run_first_step(baseline, "baseline step")
            first_sched = _run_first_step(scheduled, "scheduled step")
        if schedule.tolerance() is not None:
            return baseline, scheduled, _variants_check(schedule, first_base, first_sched)
        return baseline, scheduled, compare(first_base, first_sched)
    except NoDeterministicKernel as err:
        reason = str(err)
    except FingerprintError:
        # Deterministic mode can pick other kernels (attention) than the profile saw; a model
        # that really differs fails the same check again below, outside it.
        reason = "deterministic algorithms select other kernels for this model"
    del baseline, scheduled
    baseline, scheduled = _build_pair(schedule, device)
    first_base = _run_first_step(baseline, "baseline step")
    first_sched = _run_first_step(scheduled, "scheduled step")
    if schedule.tolerance() is not None:  # the variants' stated tolerance covers both differences
        return baseline, scheduled, _variants_check(schedule, first_base, first_sched, nondeterministic=reason)
    rtol, atol = TOLERANCES[schedule.model.precision]
    return (
        baseline,
        scheduled,
        compare(first_base, first_sched, mode="tolerance", rtol=rtol, atol=atol, nondeterministic=reason),
    )


def check_gradients(schedule: Schedule, device: torch.device) -> CheckResult:
    """The first step of the scheduled and the unmodified model compared, as ``apply --check`` does."""
    configure_cuda(device)
    return _checked_first_steps(schedule, device)[2]


def _variants_check(
    schedule: Schedule, first_base: dict, first_sched: dict, *, nondeterministic: str = ""
) -> CheckResult:
    rtol, atol = schedule.tolerance()  # type: ignore[misc]
    return compare(
        first_base,
        first_sched,
        mode="variants",
        rtol=rtol,
        atol=atol,
        nondeterministic=nondeterministic,
        variants=tuple(v.module for v in schedule.inexact_variants()),
    )


class Window(Protocol):
    """Times the profile's workload once per timed pair (``monet_cli/profiler/window.py``)."""

    def start(self, workload: Workload) -> None: ...

    def tick(self, as_written_ms: float) -> None: ...

    def in_window(self) -> Profile: ...


def run_apply(
    schedule: Schedule,
    device: torch.device,
    *,
    steps: int,
    check: bool,
    progress: Callable[[str], None] = lambda label: None,
    timeline: bool = False,
    window: Window | None = None,
) -> ApplyReport:
    configure_cuda(device)
    keep_freed_host_memory()  # time the steps as the profile did
    progress("first step (fingerprint check)")
    if check:
        baseline, scheduled, result = _checked_first_steps(schedule, device)
    else:
        baseline, scheduled = _build_pair(schedule, device)
        _run_first_step(baseline, "baseline step")  # its optimizer state exists before its peak is taken
        _run_first_step(scheduled, "scheduled step")
        result = None
    progress("measuring peak memory")
    base_peak = run_checked(
        lambda: measure_peak(baseline, CHECK_SEED + 1, timeline=timeline, beside=scheduled), "baseline step"
    )
    sched_peak = run_checked(
        lambda: measure_peak(
            scheduled, CHECK_SEED + 1, timeline=timeline, beside=baseline, machinery=machinery(scheduled.model)
        ),
        "scheduled step",
    )
    if window is not None:
        window.start(_profiled_workload(schedule.model, device, baseline))
    cpu_times = read_cpu_times()
    base_ms, sched_ms = _timed_pairs(baseline, scheduled, steps, progress, window)
    warn_if_shared(
        others_busy_since(cpu_times) if device.type == "cpu" else None,
        "apply timed its steps",
        "the measured overhead may say more about that work than about the schedule",
    )
    if window is None:
        warn_if_other_speed(schedule.predicted.baseline_step_ms, statistics.median(base_ms))
    return ApplyReport(
        budget_bytes=schedule.budget_bytes,
        predicted_peak_bytes=schedule.predicted.peak_bytes,
        measured_peak_bytes=sched_peak.peak_bytes,
        baseline_peak_bytes=base_peak.peak_bytes,
        step_ms=round(statistics.median(sched_ms), 3),
        baseline_step_ms=round(statistics.median(base_ms), 3),
        predicted_overhead=schedule.predicted.overhead,
        profiled_baseline_step_ms=schedule.predicted.baseline_step_ms,
        paired_overheads=tuple(round(s / b - 1, 6) for s, b in zip(sched_ms, base_ms)),
        check=result,
        meter=sched_peak.meter,
        timeline=sched_peak.timeline,
        baseline_timeline=base_peak.timeline,
        predicted_here=None if window is None else predicted_for(schedule, window.in_window()),
    )


def warn_if_other_speed(profiled_ms: float, measured_ms: float) -> None:
    """Warn when the unmodified step ran at another speed than when the schedule's profile
    timed it. A step's parts do not change speed alike (on this project's CPU a slow spell
    slowed the backward more than the forward a recompute re-runs): tiny_gpt profiles whose
    step ran 1.16 to 1.30 times faster or slower than a measurement's missed its deepest plans
    by up to 7.6 points, where those at its speed held within 2.1 (12-06)."""
    if other_speed(profiled_ms, measured_ms):
        warnings.warn(
            f"monet: the unmodified step took {measured_ms:.1f} ms here and {profiled_ms:.1f} ms when the "
            "schedule's profile timed it (another machine, or this one at another speed); the predicted overhead "
            "holds at the profile's speed, and the parts of a step do not change speed alike: profile on this "
            "machine for a prediction at its speed",
            stacklevel=2,
        )


def _profiled_workload(spec: ModelSpec, device: torch.device, baseline: Workload) -> Workload:
    """The workload ``spec``'s profile timed: the unmodified one where monet's preparation
    switches no activation out of place (so no third model takes memory), else built."""
    if not (spec.out_of_place_activations and in_place_activations(baseline.model)):
        return baseline
    return run_checked(lambda: build_workload(spec, device), "building the profiled model")


def _timed_pairs(
    baseline: Workload,
    scheduled: Workload,
    steps: int,
    progress: Callable[[str], None],
    window: Window | None = None,
) -> tuple[list[float], list[float]]:
    """``steps`` pairs of one unmodified and one scheduled step, in ms, the first of each pair
    taking turns: a step that runs second in every pair can gain or lose by what the first left
    behind (caches, the allocator's free blocks). ``window`` ticks after each pair."""
    base_ms, sched_ms = [], []
    for i in range(steps):
        progress(f"timing steps ({i + 1}/{steps})")
        seed = CHECK_SEED + 2 + i
        pair = [(baseline, base_ms, "baseline step"), (scheduled, sched_ms, "scheduled step")]
        for workload, times, label in pair if i % 2 == 0 else reversed(pair):
            times.append(run_checked(lambda: workload.timed_step(seed), label))  # noqa: B023 (called now)
        if window is not None:
            run_checked(lambda: window.tick(base_ms[-1]), "profiled step")
    return base_ms, sched_ms
