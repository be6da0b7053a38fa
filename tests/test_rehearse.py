"""The profile's rehearsal finds module calls that checkpoint's recompute would not repeat.

Each class of model state that breaks a recompute gets a small model: a growing cache (the
KV cache behind the GPT-2 overshoot and the LLaMA crash), a call counter, autocast's weight
cache. Models whose recompute is exact (dropout, BatchNorm) keep every call.
"""

from __future__ import annotations

import pytest
import torch
from conftest import small_spec

from monet_cli.core.plan import build_schedule
from monet_cli.core.profile import InputSpec
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.search import Planner, solver_info
from monet_cli.profiler.run import profile_model
from monet_cli.runtime.compare import run_apply
from monet_cli.workload.resolve import Overrides, resolve_model_spec

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
