"""Schedules applied to real runs: the simulator's peak matches the meter, gradients match."""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
import torch
from conftest import small_spec

from monet_cli.core.plan import build_schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import simulate
from monet_cli.core.solver.heuristics import level_plans
from monet_cli.core.solver.search import Planner
from monet_cli.errors import FingerprintError
from monet_cli.profiler.run import profile_model
from monet_cli.runtime.compare import run_apply
from monet_cli.workload.resolve import Overrides, resolve_model_spec
from tests.schedules_for_tests import INFO, plan_schedule

CPU = torch.device("cpu")

WORKLOADS = {
    "resnet18": lambda: small_spec("resnet18", shape=(3, 64, 64), batch_size=8),
    "tiny_gpt_dropout": lambda: resolve_model_spec(
        "monet_cli.examples.models:tiny_gpt",
        Overrides(
            batch_size=4,
            loss="token_cross_entropy",
            optimizer="adamw",
            inputs=(
                __import__("monet_cli.core.profile", fromlist=["InputSpec"]).InputSpec(
                    shape=(32,), dtype="int64", low=0, high=128
                ),
            ),
            model_kwargs={"vocab_size": 128, "seq_len": 32, "n_layers": 2, "dropout": 0.1},
        ),
    ),
    "skip_concat": lambda: small_spec("monet_cli.examples.models:skip_concat_net", shape=(3, 32, 32), batch_size=8),
}


@pytest.fixture(scope="module", params=list(WORKLOADS))
def workload_profile(request):
    spec = WORKLOADS[request.param]()
    return request.param, profile_model(spec, CPU, steps=1)


def _plans(profile) -> dict[str, tuple[dict, frozenset[int]]]:
    """Plans with the operator variants chosen beside them."""
    model = SegmentModel(profile)
    levels = level_plans(model)
    # every segment at its level, all recompute; the level with the most segments
    finest = max(levels.values(), key=len)
    plans = {"none": ({}, frozenset()), "all-recompute": (finest, frozenset())}
    planner = Planner(model)
    floor = planner.minimum_peak(time_limit_s=5, workers=1, seed=0).peak_bytes
    base = profile.baseline.peak_bytes
    for frac in (0.9, 0.5):
        budget = floor + int((base - floor) * frac)
        outcome = planner.solve(budget, time_limit_s=10, workers=1, seed=0)
        assert outcome.plan is not None and outcome.result.peak_bytes <= budget
        plans[f"solver-{frac}"] = (outcome.plan, outcome.variants)
    return plans


def test_simulator_matches_measured_peak_and_grads(workload_profile):
    name, profile = workload_profile
    model = SegmentModel(profile)
    for label, (plan, variants) in _plans(profile).items():
        schedule = plan_schedule(profile, plan, model=model, variants=variants)
        report = run_apply(schedule, CPU, steps=1, check=True)
        predicted = simulate(profile, plan, model=model, variants=variants).peak_bytes
        error = abs(predicted - report.measured_peak_bytes) / report.measured_peak_bytes
        assert error <= 0.02, f"{name}/{label}: predicted {predicted}, measured {report.measured_peak_bytes}"
        assert report.check is not None
        assert report.check.grads_match, f"{name}/{label}: max grad diff {report.check.max_grad_diff}"
        assert report.check.params_match and report.check.buffers_match, f"{name}/{label}"
        if plan:
            assert report.measured_peak_bytes != report.baseline_peak_bytes or label != "all-recompute"


def test_fingerprint_mismatch_raises_on_first_forward():
    import monet_cli
    from monet_cli.workload.step import build_workload

    profile = profile_model(small_spec("resnet18", shape=(3, 32, 32), batch_size=2), CPU, steps=1)
    model = SegmentModel(profile)
    plan = next(iter(level_plans(model).values()))
    schedule = build_schedule(
        profile, plan, budget_bytes=1, budget_spec="1", solver=INFO, profile_sha256="", model=model
    )
    other = build_workload(small_spec("resnet18", shape=(3, 32, 32), batch_size=3), CPU)
    monet_cli.apply(other.model, schedule)
    # A first forward that raises leaves no dispatch mode behind, and the next one is checked.
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    with pytest.raises(RuntimeError):
        other.model(torch.zeros(3, 5, 32, 32))
    assert _get_current_dispatch_mode() is None
    with pytest.raises(FingerprintError, match="input shapes differ"):
        other.forward_loss()


def test_batchnorm_state_stays_equal_over_steps():
    """Recompute stops inside BatchNorm; its running stats, counter and momentum must survive."""
    from monet_cli.runtime.compare import _first_step, compare
    from monet_cli.runtime.executor import apply_schedule
    from monet_cli.workload.step import build_workload

    spec = small_spec("resnet18", shape=(3, 32, 32), batch_size=4)
    profile = profile_model(spec, CPU, steps=1)
    model = SegmentModel(profile)
    plan = max(level_plans(model).values(), key=len)  # includes lone BatchNorms and downsample blocks
    schedule = build_schedule(
        profile, plan, budget_bytes=1, budget_spec="1", solver=INFO, profile_sha256="", model=model
    )
    baseline = build_workload(spec, CPU, prepare=False)
    scheduled = build_workload(spec, CPU)
    apply_schedule(scheduled.model, schedule)
    for _ in range(2):
        result = compare(_first_step(baseline), _first_step(scheduled))
        assert result.ok, result
    momenta = {m.momentum for m in scheduled.model.modules() if isinstance(m, torch.nn.BatchNorm2d)}
    assert momenta == {0.1}


def test_run_model_runs_the_model_it_is_given_even_an_empty_container():
    """``run_model(model)`` runs ``model``, never the workload's own in its place: an empty
    Sequential (or a compiled model forwarding ``len``) is a model, whatever its truth value."""
    from monet_cli.workload.step import build_workload

    workload = build_workload(small_spec("tests.models_for_tests:two_branch_mlp", shape=(16,), batch_size=4), CPU)
    identity = torch.nn.Sequential()
    assert len(identity) == 0
    assert workload.run_model(identity) is workload.inputs[0]


def test_precision_is_part_of_the_fingerprint():
    """A schedule profiled under bf16 autocast refuses an fp32 forward, and holds under bf16."""
    import monet_cli
    from monet_cli.core.profile import InputSpec
    from monet_cli.workload.step import build_workload

    spec = resolve_model_spec(
        "monet_cli.examples.models:tiny_gpt",
        Overrides(
            batch_size=2,
            precision="bf16-mixed",
            inputs=(InputSpec(shape=(16,), dtype="int64", low=0, high=512),),
            model_kwargs={"n_layers": 1},
        ),
    )
    profile = profile_model(spec, CPU, steps=1)
    assert profile.fingerprint.precision == "bf16-mixed"
    model = SegmentModel(profile)
    schedule = build_schedule(
        profile,
        next(iter(level_plans(model).values())),
        budget_bytes=1,
        budget_spec="1",
        solver=INFO,
        profile_sha256="",
        model=model,
    )
    bf16 = build_workload(spec, CPU)
    monet_cli.apply(bf16.model, schedule)
    bf16.forward_loss()  # runs under the spec's autocast: accepted
    fp32 = build_workload(spec, CPU)
    monet_cli.apply(fp32.model, schedule)
    args, kwargs = fp32.call_args()
    with pytest.raises(FingerprintError, match="precision bf16-mixed, this forward runs in 32"):
        fp32.model(*args, **kwargs)


@pytest.mark.parametrize(
    "spec",
    [
        lambda: small_spec("tests.models_for_tests:two_branch_mlp", shape=(16,), batch_size=64),
        lambda: small_spec("resnet18", shape=(3, 32, 32), batch_size=4),
    ],
    ids=["two_branch", "resnet18"],
)
def test_nested_segments_match_the_measured_step_op_by_op(spec):
    """An outer segment recomputes its nested segment's arguments; the inner one recomputes
    from them. Live bytes after every op, recomputes included, equal the simulator's."""
    from monet_cli.core.solver.linear import live_series

    profile = profile_model(spec(), CPU, steps=1)
    model = SegmentModel(profile)
    pairs = model.nest_pairs
    plans = [{o: frozenset(), i: frozenset()} for o, i in pairs[:: max(1, len(pairs) // 4)]]
    plans.append(Planner(model).minimum_peak(time_limit_s=10, workers=1, seed=0).plan)
    for plan in plans:
        schedule = plan_schedule(profile, plan, model=model)
        report = run_apply(schedule, CPU, steps=1, check=True, timeline=True)
        names = sorted(model.segments[c].fqn for c in plan)
        assert report.timeline == live_series(model, plan), names
        assert report.check.grads_match and report.check.params_match and report.check.buffers_match, names


def test_an_op_without_a_deterministic_kernel_is_checked_within_the_stated_tolerance():
    """Gradients are compared bit for bit under deterministic algorithms; a model using ``put``
    (no deterministic kernel) is compared again on fresh models within the precision's
    tolerance, and the result names the op."""
    spec = small_spec("tests.models_for_tests:put_mlp", shape=(16,), batch_size=8)
    profile = profile_model(spec, CPU, steps=1)
    model = SegmentModel(profile)
    plan = max(level_plans(model).values(), key=len)
    schedule = plan_schedule(profile, plan, peaks=1, model=model)
    report = run_apply(schedule, CPU, steps=1, check=True)
    check = report.check
    assert check.mode == "tolerance" and "put_" in check.nondeterministic, check
    assert (check.rtol, check.atol) == (1e-3, 1e-5) and check.ok
    assert "within rtol 0.001" in check.describe()
    assert not torch.are_deterministic_algorithms_enabled()
    assert report.measured_peak_bytes == report.predicted_peak_bytes


def test_a_model_with_deterministic_kernels_is_checked_bit_for_bit(workload_profile):
    _, profile = workload_profile
    model = SegmentModel(profile)
    plan = next(iter(level_plans(model).values()))
    schedule = plan_schedule(profile, plan, peaks=1, model=model)
    check = run_apply(schedule, CPU, steps=1, check=True).check
    assert check.mode == "exact" and check.ok and check.max_grad_diff == 0.0
    assert check.describe() == "bit-exact (deterministic algorithms)"


class _TimedStub:
    """A workload whose timed steps take the given times, each logging its name."""

    def __init__(self, name: str, times: list[float], log: list[object]) -> None:
        self.name, self.times, self.log = name, iter(times), log

    def timed_step(self, seed: int) -> float:
        self.log.append(self.name)
        return next(self.times)


def test_apply_times_pairs_in_turns_and_takes_the_median_of_their_overheads():
    """The unmodified and the scheduled step take turns going first, and the overhead is the
    median of the pairs' own overheads, with their range: a slow spell that covers one pair
    moves both of its steps, not the median."""
    from dataclasses import replace

    from monet_cli.runtime import compare

    order: list[object] = []
    baseline = _TimedStub("baseline", [100.0, 100.0, 200.0, 100.0], order)
    scheduled = _TimedStub("scheduled", [110.0, 120.0, 230.0, 105.0], order)  # the third pair twice as slow
    base_ms, sched_ms = compare._timed_pairs(baseline, scheduled, 4, lambda label: None)
    assert order == ["baseline", "scheduled", "scheduled", "baseline"] * 2
    report = compare.ApplyReport(
        budget_bytes=1,
        predicted_peak_bytes=1,
        measured_peak_bytes=1,
        baseline_peak_bytes=1,
        step_ms=125.0,
        baseline_step_ms=100.0,
        predicted_overhead=0.1,
        profiled_baseline_step_ms=100.0,
        paired_overheads=tuple(s / b - 1 for s, b in zip(sched_ms, base_ms)),
        check=None,
        meter="live-storages",
    )
    assert report.overhead == pytest.approx(0.125)  # the ratio of the medians would say +15%
    assert report.overhead_range == pytest.approx((0.05, 0.2))
    assert replace(report, paired_overheads=(0.3,)).overhead_range == (0.3, 0.3)


def test_apply_warns_when_the_step_runs_at_another_speed_than_profiled():
    """The predicted overhead holds at the speed its profile timed the step: a measured
    unmodified step more than ``SPEED_CHANGE`` times (and ``SPEED_CHANGE_MIN_MS``) off it
    says so, either way; within it, or on a sub-millisecond step's jitter, nothing."""
    import warnings

    from monet_cli.core.profile import SPEED_CHANGE
    from monet_cli.runtime.compare import warn_if_other_speed

    with pytest.warns(UserWarning, match=r"took 61\.0 ms here and 50\.0 ms when the schedule's profile timed it"):
        warn_if_other_speed(50.0, 50.0 * SPEED_CHANGE * 1.017)
    with pytest.warns(UserWarning, match=r"took 40\.0 ms here and 50\.0 ms"):
        warn_if_other_speed(50.0, 40.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_other_speed(50.0, 50.0 * SPEED_CHANGE * 0.99)
        warn_if_other_speed(50.0, 50.0 / SPEED_CHANGE * 1.01)
        warn_if_other_speed(0.5, 0.9)


def test_a_profile_timed_again_predicts_from_the_window_s_times():
    """The window's times put into the shipped gpt profile: its own times give its own
    predictions; a machine twice as slow everywhere, the same overheads; a step slower in its
    backward only (the forward's calls as before), less overhead. The model as written takes
    the median of its paired ratios to the window's steps."""
    from monet_cli.core.plan import predicted_for, solve_schedule
    from monet_cli.core.profile import load_profile
    from monet_cli.core.segments import SegmentModel
    from monet_cli.core.solver.search import Planner
    from monet_cli.profiler.capture import Timings
    from monet_cli.profiler.window import in_window

    profile = load_profile(Path("configs/gpt.profile.yaml"))
    planner = Planner(SegmentModel(profile))
    schedule, _ = solve_schedule(
        planner, profile.baseline.peak_bytes // 2, "50%", time_limit_s=20, workers=1, seed=0, relative_gap=0.01
    )
    assert schedule is not None
    own = predicted_for(schedule, profile).overhead
    assert own == schedule.predicted.overhead

    def again(step_scale: float, call_scale: float) -> float:
        calls = [call.time_ms * call_scale for call in profile.calls]
        timings = Timings(step_ms=[profile.baseline.step_ms * step_scale] * 3, call_ms=[calls] * 3)
        window = in_window(profile, timings)
        return predicted_for(schedule, window).overhead

    assert again(1.0, 1.0) == pytest.approx(own, abs=1e-5)
    assert again(2.0, 2.0) == pytest.approx(own, abs=1e-5)
    assert again(1.2, 1.0) < own / 1.1
    # The model as written, paired repeat by repeat with the window's steps: 5%, 5% and 10% faster
    # (the ratio of the medians would say 10%).
    calls = [[call.time_ms for call in profile.calls]] * 3
    window = in_window(profile, Timings(step_ms=[80.0, 100.0, 90.0], call_ms=calls), [76.0, 95.0, 81.0])
    assert window.baseline.step_ms == 90.0 and window.baseline.as_written_step_ms == pytest.approx(85.5)


def test_apply_times_the_profiled_step_after_every_pair_with_that_pair_s_unmodified_step():
    """A window ticks once after each pair, given the pair's unmodified step (the model as
    written, paired with it)."""
    from monet_cli.runtime import compare

    events: list[object] = []

    class Window:
        def tick(self, as_written_ms: float) -> None:
            events.append(as_written_ms)

    baseline = _TimedStub("baseline", [100.0, 90.0, 200.0], events)
    scheduled = _TimedStub("scheduled", [110.0, 120.0, 230.0], events)
    compare._timed_pairs(baseline, scheduled, 3, lambda label: None, Window())
    assert events == ["baseline", "scheduled", 100.0, "scheduled", "baseline", 90.0, "baseline", "scheduled", 200.0]


def test_the_profiled_step_is_the_unmodified_model_unless_monet_s_preparation_changes_it():
    """Where no activation runs in place (tiny_gpt), the unmodified model is what the profile
    timed and no third model is built; resnet18's in-place ReLUs need a prepared one, whose
    as-written step is then paired with the window's."""
    from monet_cli.runtime.compare import _profiled_workload
    from monet_cli.workload.step import build_workload

    gpt = WORKLOADS["tiny_gpt_dropout"]()
    plain = build_workload(gpt, CPU, prepare=False)
    assert _profiled_workload(gpt, CPU, plain) is plain
    spec = small_spec()
    as_written = build_workload(spec, CPU, prepare=False)
    prepared = _profiled_workload(spec, CPU, as_written)
    assert prepared is not as_written and prepared.out_of_place


def test_apply_prices_the_schedule_again_in_its_own_run(resnet18_profile, monkeypatch):
    """A real apply with a window: one timed step of the prepared model per pair, and the
    schedule predicted again from them at that run's step; no warning that the step ran at
    another speed than profiled, since the prediction is at this one."""
    import warnings

    from monet_cli.core.plan import predicted_for
    from monet_cli.profiler.window import WindowTimer
    from monet_cli.runtime import compare

    monkeypatch.setattr(compare, "other_speed", lambda profiled_ms, measured_ms: True)
    model = SegmentModel(resnet18_profile)
    schedule = plan_schedule(resnet18_profile, max(level_plans(model).values(), key=len), model=model)
    window = WindowTimer(resnet18_profile)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        report = run_apply(schedule, CPU, steps=3, check=False, window=window)
    assert not [w for w in caught if "when the schedule's profile timed it" in str(w.message)]
    assert len(window.timings.step_ms) == len(window.as_written_ms) == 3
    assert window.workload.out_of_place  # resnet18's ReLUs run in place as written
    priced = window.in_window()
    assert priced.baseline.step_ms == statistics.median(window.timings.step_ms)
    here = predicted_for(schedule, priced)
    assert report.predicted_here == here  # the report's, from the same window
    assert here.baseline_step_ms == priced.baseline.as_written_step_ms is not None
    assert here.overhead > 0
