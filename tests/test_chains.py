"""Segments over chains of sibling calls: which runs qualify, and that one checkpoint frame
spanning several calls holds the simulator's timeline and the unmodified model's gradients."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import small_spec
from typer.testing import CliRunner

import monet_cli
from monet_cli.cli.app import app
from monet_cli.core.profile import save_profile
from monet_cli.core.schedule import load_schedule, save_schedule
from monet_cli.core.segments import CHAIN, SegmentModel
from monet_cli.core.simulate import simulate
from monet_cli.core.solver.linear import live_series
from monet_cli.core.solver.search import Planner
from monet_cli.errors import FingerprintError
from monet_cli.profiler.run import profile_model
from monet_cli.runtime.compare import run_apply
from monet_cli.workload.step import build_workload
from tests.schedules_for_tests import plan_schedule

CPU = torch.device("cpu")


def _chains(model: SegmentModel) -> dict[str, int]:
    return {model.calls[c].fqn: c for c in model.segments if model.calls[c].type == CHAIN}


@pytest.fixture(scope="module")
def handoff_profile():
    return profile_model(small_spec("tests.models_for_tests:handoff_net", shape=(16,), batch_size=8), CPU, steps=1)


def test_a_chain_is_a_run_of_leaf_siblings_passing_one_tensor_along(resnet18_profile, handoff_profile):
    resnet = SegmentModel(resnet18_profile)
    chains = _chains(resnet)
    assert resnet.segments[chains["conv1..maxpool"]].members == ("conv1", "bn1", "relu", "maxpool")
    # Blocks hold sub-calls: no chain spans them. A BasicBlock calls its relu twice: never a member.
    assert not any(name.startswith("layer1..") or ".relu" in name for name in chains)
    # up's output is read by the residual after down: up cannot hand off; act, down, drop can.
    handoff = SegmentModel(handoff_profile)
    assert list(_chains(handoff)) == ["act..drop"]
    chain = handoff.segments[_chains(handoff)["act..drop"]]
    assert (chain.first_op, chain.end_op) == (handoff_profile.calls[2].first_op, handoff_profile.calls[4].end_op)
    # A chain encloses its members, so the solver treats them as nested in it.
    assert all(handoff.ancestors[c][1] == chain.call for c in (2, 3, 4))


def test_a_chain_member_is_called_with_the_one_before_s_output_alone():
    """vit_b_16's attention takes its LayerNorm's output three times and a keyword, and returns
    a tuple: a chain over either hand-off would be refused by the executor on its first
    forward, so none is offered. The calls after it pass one tensor along: a chain, and it
    runs within its prediction (in backward the step holds 1 KiB less than the simulator
    says at two ops: the safe side) with the unmodified model's gradients."""
    profile = profile_model(
        small_spec("tests.models_for_tests:norm_attention_net", shape=(4, 16), batch_size=4), CPU, steps=1
    )
    model = SegmentModel(profile)
    chains = _chains(model)
    assert list(chains) == ["fc..out"]
    by_name = {call.fqn: call for call in profile.calls}
    assert not by_name["attn"].hand_off and not by_name["fc"].hand_off
    assert by_name["act"].hand_off and by_name["out"].hand_off
    plan = {chains["fc..out"]: frozenset()}
    schedule = plan_schedule(profile, plan, model=model)
    report = run_apply(schedule, CPU, steps=1, check=False, timeline=True)
    predicted = live_series(model, plan)
    assert len(report.timeline) == len(predicted) and all(m <= p for m, p in zip(report.timeline, predicted))
    assert report.measured_peak_bytes == schedule.predicted.peak_bytes
    checked = run_apply(schedule, CPU, steps=2, check=True)
    assert checked.check.grads_match and checked.check.params_match and checked.check.buffers_match


def test_a_schedule_is_refused_against_a_profile_that_offers_other_segments(handoff_profile):
    """A schedule names its segments by their index among what its profile offered. A profile
    made before calls recorded their hand-off offers no chains, so its indices name other
    segments: the schedule's plan is refused in one line, not simulated on the wrong ones."""
    from dataclasses import replace

    from monet_cli.core.plan import plan_of
    from monet_cli.errors import UsageError

    model = SegmentModel(handoff_profile)
    chain = _chains(model)["act..drop"]
    schedule = plan_schedule(handoff_profile, {chain: frozenset()}, peaks=1, model=model)
    assert plan_of(schedule, model) == {chain: frozenset()}
    older = replace(handoff_profile, calls=tuple(replace(c, hand_off=False) for c in handoff_profile.calls))
    with pytest.raises(UsageError, match="the profile offers no segment 'act..drop'"):
        plan_of(schedule, SegmentModel(older))


def test_a_nested_segment_recomputes_with_its_arguments_aliased_as_in_the_forward():
    """Self-attention called with one tensor as query, key and value takes the packed
    projection; three distinct tensors would take another path, with other saved tensors. A
    segment nested in another gets its arguments back from the outer frame's saved tensors:
    one tensor passed three times must come back as one, or the recompute fails checkpoint's
    metadata check (vit_b_16's smallest-peak schedule did)."""
    profile = profile_model(
        small_spec("tests.models_for_tests:attention_block_net", shape=(4, 16), batch_size=4), CPU, steps=1
    )
    model = SegmentModel(profile)
    by_name = {seg.fqn: c for c, seg in model.segments.items()}
    plan = {by_name["0"]: frozenset(), by_name["0.attn"]: frozenset()}
    assert (by_name["0"], by_name["0.attn"]) in model.nest_pairs
    _check(profile, plan)


def _check(profile, plan):
    """One step op by op against the simulator; two steps against the unmodified model (the
    second starts from BatchNorm statistics the first updated)."""
    model = SegmentModel(profile)
    schedule = plan_schedule(profile, plan, model=model)
    report = run_apply(schedule, CPU, steps=1, check=False, timeline=True)
    assert report.timeline == live_series(model, plan)
    checked = run_apply(schedule, CPU, steps=2, check=True)
    assert checked.check.grads_match and checked.check.params_match and checked.check.buffers_match
    return schedule, report


def test_the_resnet_stem_as_one_segment_matches_the_simulator_op_by_op(resnet18_profile):
    model = SegmentModel(resnet18_profile)
    stem = _chains(model)["conv1..maxpool"]
    bn1 = next(c for c in model.segments if model.calls[c].fqn == "bn1")
    keep = frozenset(model.segments[stem].candidates[:1])
    end_of_forward = len(resnet18_profile.ops)
    unscheduled = live_series(model, {})[end_of_forward]
    for plan in ({stem: frozenset()}, {stem: keep}, {stem: frozenset(), bn1: frozenset()}):
        schedule, report = _check(resnet18_profile, plan)
        assert report.timeline[end_of_forward] < unscheduled  # the stem's activations are gone
    assert schedule.segments[0].chain == ("conv1", "bn1", "relu", "maxpool")


def test_a_chain_with_dropout_recomputes_the_same_mask(handoff_profile):
    chain = _chains(SegmentModel(handoff_profile))["act..drop"]
    _check(handoff_profile, {chain: frozenset()})


@pytest.fixture(scope="module")
def stem_profile():
    return profile_model(small_spec("tests.models_for_tests:stem_net", shape=(3, 32, 32), batch_size=8), CPU, steps=1)


def test_the_solver_uses_the_stem_chain_to_reach_lower(stem_profile):
    profile = stem_profile
    model = SegmentModel(profile)
    stem = _chains(model)["conv..pool"]
    lowest = Planner(model, variants=False).minimum_peak(time_limit_s=10, workers=1, seed=0)
    assert stem in lowest.plan
    without = {c: keep for c, keep in lowest.plan.items() if c != stem}
    assert lowest.peak_bytes < simulate(profile, without, model=model).peak_bytes
    _check(profile, lowest.plan)


def test_a_chain_schedule_round_trips_and_refuses_another_handoff(handoff_profile, tmp_path):
    chain = _chains(SegmentModel(handoff_profile))["act..drop"]
    schedule = plan_schedule(handoff_profile, {chain: frozenset()})
    save_schedule(schedule, tmp_path / "s.yaml")
    loaded = load_schedule(tmp_path / "s.yaml")
    assert loaded == schedule and loaded.segments[0].members == ("act", "down", "drop")

    spec = small_spec("tests.models_for_tests:handoff_net", shape=(16,), batch_size=8, model_kwargs={"reroute": True})
    workload = build_workload(spec, CPU)
    monet_cli.apply(workload.model, schedule, check_fingerprint=False)
    args, kwargs = workload.call_args()
    with torch.no_grad():
        workload.model(*args, **kwargs)  # nothing is saved without grad: the chain stays closed and checks nothing
    with pytest.raises(FingerprintError, match="'down' was not called right after 'act' with its output alone"):
        workload.model(*args, **kwargs)
    # The frame was closed on the way out: no saved-tensor hooks are left behind.
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_forward_that_raised_inside_a_chain_does_not_leave_its_frame_behind(handoff_profile):
    chain = _chains(SegmentModel(handoff_profile))["act..drop"]
    schedule = plan_schedule(handoff_profile, {chain: frozenset()})
    workload = build_workload(handoff_profile.model, CPU)
    monet_cli.apply(workload.model, schedule, check_fingerprint=False)
    raised = []

    def raise_once(module, args, output):  # a user's hook failing between two members of the chain
        if not raised:
            raised.append(True)
            raise RuntimeError("hook failed")

    workload.model.act.register_forward_hook(raise_once)
    with pytest.raises(RuntimeError, match="hook failed"):
        workload.run_model()
    workload.loss_fn(workload.run_model()).backward()  # the next forward closes the stale frame first
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert all(p.grad is not None for p in workload.model.parameters())


def test_cli_solve_inspect_and_validate_show_the_chain(stem_profile, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "stem.profile.yaml"
    save_profile(stem_profile, path)
    floor = Planner(SegmentModel(stem_profile), variants=False).minimum_peak(time_limit_s=10, workers=1, seed=0)
    runner = CliRunner()
    solved = runner.invoke(
        app,
        [
            "solve",
            str(path),
            "--budget",
            str(floor.peak_bytes),
            "--no-variants",
            "--workers",
            "1",
            "--json",
            "-o",
            "s.yaml",
        ],
    )
    assert solved.exit_code == 0, solved.output
    assert json.loads(solved.stdout)["chains"] == 1
    report = json.loads(runner.invoke(app, ["inspect", "s.yaml", "--json"]).stdout)
    assert {"module": "conv..pool", "chain": ["conv", "bn", "relu", "pool"]}.items() <= next(
        s for s in report["segments"] if s["chain"]
    ).items()
    profile_report = json.loads(runner.invoke(app, ["inspect", str(path), "--json"]).stdout)
    assert profile_report["chains"] == [["conv", "bn", "relu", "pool"]]
    checked = runner.invoke(app, ["validate", "s.yaml", "--json"])
    assert checked.exit_code == 0, checked.output
