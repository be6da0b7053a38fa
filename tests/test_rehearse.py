"""The profile's rehearsal finds module calls that checkpoint's recompute would not repeat.

Each class of model state that breaks a recompute gets a small model: a growing cache (the
KV cache behind the GPT-2 overshoot and the LLaMA crash), a call counter, autocast's weight
cache. Models whose recompute is exact (dropout, BatchNorm) keep every call.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from conftest import small_spec
from typer.testing import CliRunner

from monet_cli.cli.app import app
from monet_cli.core.plan import build_schedule, solve_schedule
from monet_cli.core.profile import InputSpec, save_profile
from monet_cli.core.schedule import save_schedule, with_content_hash
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.search import Planner, solver_info
from monet_cli.errors import FingerprintError
from monet_cli.profiler.run import profile_model
from monet_cli.runtime.compare import run_apply
from monet_cli.runtime.executor import apply_schedule, machinery
from monet_cli.runtime.meter import measure_peak
from monet_cli.workload.resolve import Overrides, resolve_model_spec
from monet_cli.workload.step import Workload, build_workload
from tests.schedules_for_tests import plan_schedule

CPU = torch.device("cpu")


def _profile(factory: str, shape: tuple[int, ...], precision: str = "32"):
    spec = resolve_model_spec(
        f"tests.models_for_tests:{factory}",
        Overrides(batch_size=4, inputs=(InputSpec(shape=shape),), precision=precision),
    )
    return profile_model(spec, CPU, steps=1)


def _reasons(profile) -> dict[str, str]:
    return {c.fqn: c.reason for c in profile.calls}


def test_a_growing_cache_is_found_and_never_offered():
    profile = _profile("caching_net", (8, 16))
    reasons = _reasons(profile)
    for block in ("blocks.0", "blocks.1"):
        assert reasons[block].startswith("re-running its forward runs other ops"), reasons[block]
        assert "cache" in reasons[block]
    assert reasons["blocks.0.proj"] == "" and reasons["stem"] == ""
    model = SegmentModel(profile)
    offered = {seg.fqn for seg in model.segments.values()}
    assert "stem" in offered and not offered & {"blocks.0", "blocks.1"}
    # What is offered still holds its budget with exact gradients.
    planner = Planner(model)
    floor = planner.minimum_peak(time_limit_s=5, workers=1, seed=0).peak_bytes
    assert floor < profile.baseline.peak_bytes
    outcome = planner.solve(floor, time_limit_s=5, workers=1, seed=0)
    schedule = build_schedule(
        profile,
        outcome.plan,
        budget_bytes=floor,
        budget_spec="floor",
        profile_sha256="",
        model=model,
        solver=solver_info(outcome, workers=1, seed=0, time_limit_s=5),
    )
    report = run_apply(schedule, CPU, steps=1, check=True)
    assert report.measured_peak_bytes == report.predicted_peak_bytes <= floor
    assert report.check.ok


def test_a_counter_is_found_by_its_values():
    reasons = _reasons(_profile("counting_net", (16,)))
    assert reasons["1"].startswith("re-running its forward gives other values"), reasons["1"]
    assert reasons["0"] == "" and reasons["2"] == ""


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_autocast_weight_cache_is_found_only_under_autocast(precision: str):
    reasons = _reasons(_profile("shared_weight_net", (16,), precision))
    assert reasons["first"] == ""
    if precision == "32":
        assert reasons["second"] == ""
    else:
        assert reasons["second"].startswith("re-running its forward runs"), reasons["second"]


@pytest.mark.parametrize(
    ("model", "shape"), [("monet_cli.examples.models:tiny_gpt", None), ("tests.models_for_tests:skip_cnn", (3, 16, 16))]
)
def test_exact_recomputes_keep_every_call(model: str, shape):
    if shape is None:
        spec = resolve_model_spec(
            model,
            Overrides(
                batch_size=2,
                model_kwargs={"n_layers": 2, "dropout": 0.1},
                inputs=(InputSpec(shape=(16,), dtype="int64", low=0, high=512),),
            ),
        )
    else:
        spec = small_spec(model, shape=shape)
    profile = profile_model(spec, CPU, steps=1)
    assert not [c.fqn for c in profile.calls if c.reason.startswith("re-running")]


def test_writes_after_the_call_are_told_apart():
    """An output written in place later is no reason to refuse a call; an input written later is."""
    reasons = _reasons(_profile("in_place_after_net", (16,)))
    assert reasons["first"] == ""
    assert reasons["second"].startswith("re-running its forward gives other values"), reasons["second"]


@pytest.mark.parametrize("store", [True, False])
def test_hooks_that_keep_what_a_re_run_makes_are_found(store: bool, tmp_path):
    """A forward hook collecting features runs again in a recompute and keeps the recomputed
    tensors: the blocks that run it (their re-run calls the hooked Linear) are no segments,
    and the hooked Linear itself is in no chain or range (their recomputes call it, hooks and
    all), though it may still be a segment. Hooks that keep nothing change nothing. What is
    offered holds its predicted peak exactly."""
    spec = resolve_model_spec(
        "tests.models_for_tests:hooked_net",
        Overrides(batch_size=128, inputs=(InputSpec(shape=(16,)),), model_kwargs={"store": store}),
    )
    profile = profile_model(spec, CPU, steps=1)
    calls = {c.fqn: c for c in profile.calls}
    for i in range(3):
        block, hooked = calls[f"blocks.{i}"], calls[f"blocks.{i}.a"]
        assert hooked.reason == ""
        if store:
            assert block.reason.startswith("re-running its forward leaves 32768 bytes alive"), block.reason
            assert hooked.hooks_reason.startswith("its forward hooks, run again, leave 32768 bytes alive")
        else:
            assert block.reason == hooked.hooks_reason == ""
    model = SegmentModel(profile)
    hooked_calls = {c.index for c in profile.calls if c.hooks_reason}
    assert not [r for r in model.ranges.values() if hooked_calls & set(r.calls)]
    if store:  # why: a range whose recompute calls a hooked Linear measures over its prediction
        unmarked = dataclasses.replace(
            profile, calls=tuple(dataclasses.replace(c, hooks_reason="") for c in profile.calls)
        )
        old = SegmentModel(unmarked)
        over = []
        for index, r in old.ranges.items():
            if hooked_calls & set(r.calls):
                report = run_apply(plan_schedule(unmarked, {index: frozenset()}, model=old), CPU, steps=1, check=False)
                over.append(report.measured_peak_bytes > report.predicted_peak_bytes)
        assert over and any(over)
        save_profile(profile, tmp_path / "p.yaml")  # the reasons survive the file; inspect shows them
        shown = json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path / "p.yaml"), "--json"]).stdout)
        assert [row["module"] for row in shown["not_rerun_as_calls"]] == [f"blocks.{i}.a" for i in range(3)]
        assert (
            "module calls no chain or op range re-runs"
            in CliRunner().invoke(app, ["inspect", str(tmp_path / "p.yaml")]).stdout
        )
    planner = Planner(model)
    floor = planner.minimum_peak(time_limit_s=5, workers=1, seed=0)
    assert floor.peak_bytes < profile.baseline.peak_bytes
    schedule, _ = solve_schedule(
        planner, floor.peak_bytes, "floor", time_limit_s=5, workers=1, seed=0, hint=(floor.plan, floor.variants)
    )
    report = run_apply(schedule, CPU, steps=1, check=True)
    assert report.measured_peak_bytes == report.predicted_peak_bytes <= floor.peak_bytes
    assert report.check.ok


def test_hooks_of_a_module_called_twice_are_rehearsed():
    """A module called twice is no segment, but an op range re-runs it as a call: its hooks
    are rehearsed all the same, and no range holds it when they keep what it makes."""
    profile = _profile("shared_hook_net", (16,))
    acts = [c for c in profile.calls if c.fqn == "act"]
    assert len(acts) == 2
    assert all(c.reason.startswith("called 2 times") for c in acts)
    assert all(c.hooks_reason.startswith("its forward hooks, run again, leave") for c in acts)
    model = SegmentModel(profile)
    assert model.ranges
    assert not [r for r in model.ranges.values() if {c.index for c in acts} & set(r.calls)]


def test_hooks_registered_after_the_profile_are_refused(tmp_path):
    """A training loop that registers a collecting hook after the profile holds tensors the
    profile saw freed: run unchecked, the step measures over its prediction whether or not a
    recompute runs the hook. Every training forward refuses such a model, the first and any
    later one; the hooks the profile saw pass (``test_hooks_that_keep_what_a_re_run_makes_are_found``)."""
    spec = resolve_model_spec(
        "tests.models_for_tests:hooked_net",
        Overrides(batch_size=128, inputs=(InputSpec(shape=(16,)),), model_kwargs={"store": None}),
    )
    profile = profile_model(spec, CPU, steps=1)
    assert profile.fingerprint.hooks == ()
    block = next(c.index for c in profile.calls if c.fqn == "blocks.0")
    schedule = plan_schedule(profile, {block: frozenset()})
    kept: list[torch.Tensor] = []

    def collect(module, args, output):
        kept.append(output)

    def hooked(paths: list[str], *, check: bool) -> Workload:
        workload = build_workload(spec, CPU)
        for path in paths:
            workload.model.get_submodule(path).register_forward_hook(collect)
        apply_schedule(workload.model, schedule, check_fingerprint=check)
        return workload

    def peak(workload: Workload) -> int:
        workload.timed_step(seed=0)
        kept.clear()
        return measure_peak(workload, 1, machinery=machinery(workload.model)).peak_bytes

    assert peak(hooked([], check=True)) == schedule.predicted.peak_bytes
    for path in ("blocks.0.a", "blocks.1.a"):  # in the segment, and outside it
        assert peak(hooked([path], check=False)) > schedule.predicted.peak_bytes
    late = hooked([], check=True)  # a hook registered after the first step is refused at the next one
    late.timed_step(seed=0)
    late.model.get_submodule("blocks.1.a").register_forward_hook(collect)
    with pytest.raises(FingerprintError, match="'blocks.1.a' has a forward hook the profile did not see"):
        late.timed_step(seed=0)
    refused = hooked(["blocks.1.a", "blocks.0.a"], check=True)
    with pytest.raises(FingerprintError) as raised:
        refused.timed_step(seed=0)
    assert str(raised.value) == (
        "schedule does not match this model: 'blocks.0.a' has a forward hook the profile did not see "
        f"({collect.__module__}.{collect.__qualname__}) (and 1 more); what a hook keeps is not in the "
        "prediction, and a recompute runs it again: register hooks in the model's factory, so the profile "
        "measures and rehearses them, and profile again"
    )
    save_schedule(schedule, tmp_path / "s.yaml")  # validate builds the factory's model, which registers none
    shown = CliRunner().invoke(app, ["validate", str(tmp_path / "s.yaml"), "--json"])
    assert shown.exit_code == 0, shown.output
    assert {"name": "forward hooks", "status": "passed", "detail": "none the profile did not see"} in json.loads(
        shown.stdout
    )["checks"]
    noting = dataclasses.replace(schedule.model, kwargs={"store": False})  # the factory registers hooks now
    save_schedule(with_content_hash(dataclasses.replace(schedule, model=noting)), tmp_path / "s.yaml")
    shown = CliRunner().invoke(app, ["validate", str(tmp_path / "s.yaml"), "--json"])
    assert shown.exit_code == 5, shown.output
    assert json.loads(shown.stdout)["problem"].startswith("forward hooks: 'blocks.0.a' has a forward hook the profile")
