"""Op ranges: segments over a stretch of one module's forward, its own code included. Which
stretches qualify, that the solver never runs two crossing ones, and that the frame with its
replayed tape holds the simulator's timeline op by op and the unmodified model's gradients."""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import small_spec
from typer.testing import CliRunner

import monet_cli
from monet_cli.cli.app import app
from monet_cli.core.profile import save_profile
from monet_cli.core.schedule import load_schedule, save_schedule
from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import simulate
from monet_cli.core.solver.linear import live_series
from monet_cli.core.solver.search import Planner
from monet_cli.errors import FingerprintError
from monet_cli.profiler.run import profile_model
from monet_cli.runtime.compare import run_apply
from monet_cli.workload.step import build_workload
from tests.schedules_for_tests import plan_schedule

CPU = torch.device("cpu")


def _ranges(model: SegmentModel) -> dict[str, int]:
    return {model.calls[c].fqn: c for c in model.segments if c in model.ranges}


def _range_net_spec(**model_kwargs):
    return small_spec("tests.models_for_tests:range_net", shape=(16,), batch_size=8, model_kwargs=model_kwargs)


@pytest.fixture(scope="module")
def range_net_profile():
    return profile_model(_range_net_spec(), CPU, steps=1)


def _check(profile, plan, *, exact: bool = True, below: int = 4):
    """One step op by op against the simulator; two steps against the unmodified model
    (gradients, updated parameters and buffers, bit for bit).

    Not ``exact``: a recomputed tensor that an addmm saved dies when backward has used it,
    a few ops before the node that saved it is released (checkpoint hands it over on
    unpack; the simulator holds it to the release the profile measured): below the
    prediction at those few points (at most ``below``), never above."""
    model = SegmentModel(profile)
    schedule = plan_schedule(profile, plan, model=model)
    report = run_apply(schedule, CPU, steps=1, check=False, timeline=True)
    predicted = live_series(model, plan)
    if exact:
        assert report.timeline == predicted
    else:
        assert len(report.timeline) == len(predicted)
        assert all(measured <= live for measured, live in zip(report.timeline, predicted))
        assert sum(measured < live for measured, live in zip(report.timeline, predicted)) <= below
    checked = run_apply(schedule, CPU, steps=2, check=True)
    assert checked.check.grads_match and checked.check.params_match and checked.check.buffers_match
    return schedule


def test_ranges_cover_a_blocks_own_code(resnet18_profile):
    model = SegmentModel(resnet18_profile)
    ranges = _ranges(model)
    ops = resnet18_profile.ops
    block = next(c for c in resnet18_profile.calls if c.fqn == "layer2.0")
    residual = next(i for i in range(block.first_op, block.end_op) if ops[i].module == "layer2.0")
    calls = {c.fqn: c for c in resnet18_profile.calls if c.parent == block.index}
    # From bn2 to the block's end: the downsample branch, the residual add and the last ReLU.
    tail = model.ranges[ranges[f"layer2.0[{calls['layer2.0.bn2'].first_op}:{block.end_op}]"]]
    assert tail.first_op <= residual < tail.end_op and tail.own_ops == 1
    # It closes at the end of the block's last call (its ReLU, called three times), which is the block's end.
    assert resnet18_profile.calls[tail.calls[-1]].fqn == "layer2.0.relu" and tail.closes_at_call
    assert set(tail.inputs) == {*calls["layer2.0.downsample"].inputs, *calls["layer2.0.bn2"].inputs}
    # From the downsample branch on, `out += identity` writes bn2's output, made before the
    # range, in place: a replay would add twice, so that range is not offered.
    assert ops[residual].inplace_of < calls["layer2.0.downsample"].first_op
    assert f"layer2.0[{calls['layer2.0.downsample'].first_op}:{block.end_op}]" not in ranges
    # bn2's range reads its input from conv2 and the block's input (for the downsample).
    # No range repeats a chain, and each range's frame sees its calls' saved tensors.
    chains = {(model.calls[c].first_op, model.calls[c].end_op) for c in model.members}
    assert not chains & {(r.first_op, r.end_op) for r in model.ranges.values()}
    bn2 = calls["layer2.0.bn2"].index
    assert set(model.packs_by_call[bn2]) <= set(
        model.packs_by_call[
            ranges[model.calls[ranges[f"layer2.0[{calls['layer2.0.bn2'].first_op}:{block.end_op}]"]].fqn]
        ]
    )


def test_crossing_ranges_are_never_chosen_together(range_net_profile):
    model = SegmentModel(range_net_profile)
    assert model.crossing_pairs
    a, b = model.crossing_pairs[0]
    with pytest.raises(ValueError, match="overlap"):
        simulate(range_net_profile, {a: frozenset(), b: frozenset()}, model=model)
    lowest = Planner(model, variants=False).minimum_peak(time_limit_s=10, workers=1, seed=0)
    assert not any(x in lowest.plan and y in lowest.plan for x, y in model.crossing_pairs)


@pytest.mark.parametrize(
    ("name", "exact"),
    [
        # Opens with the forward: the buffer write, dropout, BatchNorm, the ReLU called twice; its
        # recompute stops inside 'down', whose addmm saved a recomputed tensor.
        ("<model>[0:18]", False),
        ("<model>[13:21]", False),  # opens at the second call of the ReLU: the in-place add and the residual
        ("<model>[3:14]", True),  # reads the Linear's output made before it
    ],
)
def test_a_range_replays_the_modules_own_ops_exactly(range_net_profile, name, exact):
    model = SegmentModel(range_net_profile)
    schedule = _check(range_net_profile, {_ranges(model)[name]: frozenset()}, exact=exact)
    segment = schedule.segments[0]
    assert segment.within == "" and segment.own_ops == model.ranges[_ranges(model)[name]].own_ops


def test_ranges_in_a_resnet_and_a_range_holding_a_nested_segment(resnet18_profile):
    model = SegmentModel(resnet18_profile)
    ranges = _ranges(model)
    calls = {c.fqn: c for c in resnet18_profile.calls}
    tail = ranges[f"layer2.0[{calls['layer2.0.bn2'].first_op}:{calls['layer2.0'].end_op}]"]
    stem = ranges[f"<model>[{calls['bn1'].first_op}:{calls['layer1'].end_op}]"]
    _check(resnet18_profile, {tail: frozenset(), stem: frozenset()})
    outer, inner = next((o, i) for o, i in model.nest_pairs if o in model.ranges)
    _check(resnet18_profile, {outer: frozenset(), inner: frozenset()})


def test_a_range_nested_in_its_block_s_segment_holds_the_simulator_op_by_op(resnet18_profile):
    """The tape saves what the range read through the block's frame when it closes: the block
    drops those tensors in the forward and makes them again in its recompute, which runs the
    range as a checkpoint. Before, the tape held them to the end of the step. Only ranges that
    open where their module's forward opens are offered nested."""
    model = SegmentModel(resnet18_profile)
    nested = [(outer, inner) for outer, inner in model.nest_pairs if inner in model.ranges]
    assert {model.calls[outer].fqn for outer, _ in nested} == {"layer2.0", "layer3.0", "layer4.0"}
    for outer, inner in nested[:2]:
        parent = model.calls[model.ranges[inner].parent]
        assert model.calls[outer].fqn == parent.fqn and model.ranges[inner].first_op == parent.first_op
        _check(resnet18_profile, {outer: frozenset(), inner: frozenset()})
        assert model.frames({outer: frozenset(), inner: frozenset()})[outer].stop >= model.ranges[inner].end_op


@pytest.fixture(scope="module")
def resnet50_small():
    return profile_model(small_spec("resnet50", shape=(3, 32, 32), batch_size=2), CPU, steps=1)


def test_a_stage_range_holds_its_first_block_s_range_nested(resnet50_small):
    """Both frames are tapes: the stage's replay calls the block, whose range records a tape of
    its own again, saves what it read through the stage's frame, and replays later."""
    profile = resnet50_small
    model = SegmentModel(profile)
    outer, inner = next(
        (o, i)
        for o, i in model.nest_pairs
        if model.calls[o].fqn.startswith("layer1[") and model.calls[i].fqn.startswith("layer1.0[")
    )
    _check(profile, {outer: frozenset(), inner: frozenset()})


THREE_DEEP = ("layer1[6:42]", "layer1.0", "layer1.0.downsample", "layer1.1", "layer1.1.conv3..layer1.1.bn3")
"""layer1's range holds layer1.0, which holds its downsample, and layer1.1, which holds its last
convolution and BatchNorm: part of the nesting of resnet50's smallest peak (batch 32, 128 px)."""


def test_segments_nest_three_deep_and_an_outer_holds_two(resnet50_small):
    """Each recompute runs the nested ones' frames again inside it: the step holds the
    simulator's timeline op by op and the unmodified model's gradients bit for bit."""
    from monet_cli.core.simulate import nesting_problem
    from monet_cli.core.solver.linear import nest_paths

    model = SegmentModel(resnet50_small)
    by_name = {model.calls[c].fqn: c for c in model.segments}
    plan = {by_name[name]: frozenset() for name in THREE_DEEP}
    stage, block, downsample, second, branch = plan
    assert sorted(nest_paths(model, plan)) == sorted(
        [(stage, block), (stage, block, downsample), (stage, second), (stage, second, branch)]
    )
    schedule = _check(resnet50_small, plan)
    assert schedule.nested_in() == {
        "layer1.0": "layer1[6:42]",
        "layer1.0.downsample": "layer1.0",
        "layer1.1": "layer1[6:42]",
        "layer1.1.conv3..layer1.1.bn3": "layer1.1",
    }
    # The innermost's argument made by the outermost: its copy comes from the outermost's recompute.
    _check(
        resnet50_small,
        {by_name[name]: frozenset() for name in ("layer1[6:42]", "layer1.1", "layer1.1.conv1..layer1.1.bn1")},
    )
    deeper = {by_name["layer1"]: frozenset(), **plan}
    assert "deeper than 3 levels" in nesting_problem(model, deeper)


def test_the_cp_model_nests_as_the_simulator_does(resnet50_small):
    """With every segment fixed, CP-SAT accepts the three-deep plan, with its nest and triple
    variables on exactly where it nests, and refuses it four deep."""
    from ortools.sat.python import cp_model

    from monet_cli.core.solver.cpsat import build_model, extract
    from monet_cli.core.solver.linear import nest_paths

    model = SegmentModel(resnet50_small)
    by_name = {model.calls[c].fqn: c for c in model.segments}
    plan = {by_name[name]: frozenset() for name in THREE_DEEP}
    for chosen, feasible in ((plan, True), ({by_name["layer1"]: frozenset(), **plan}, False)):
        cp, v = build_model(model, [], budget_bytes=resnet50_small.baseline.peak_bytes)
        for c, var in v.seg.items():
            cp.add(var == int(c in chosen))
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        status = solver.solve(cp)
        assert (status == cp_model.OPTIMAL) == feasible, solver.status_name(status)
        if feasible:
            assert extract(solver, v) == plan
            paths = set(nest_paths(model, plan))
            assert {p for p, var in v.nest.items() if solver.boolean_value(var)} == {p[-2:] for p in paths}
            assert {t for t, var in v.triple.items() if solver.boolean_value(var)} == {p for p in paths if len(p) == 3}


@pytest.fixture(scope="module")
def gpt_profile():
    from monet_cli.workload.resolve import Overrides, resolve_model_spec

    return profile_model(resolve_model_spec("configs/gpt.yaml", Overrides(batch_size=2)), CPU, steps=1)


def test_an_attention_range_recomputes_the_same_dropout_mask(gpt_profile):
    from dataclasses import replace

    profile = gpt_profile
    model = SegmentModel(profile)
    # On this CPU attention with dropout runs as its parts: a softmax, then dropout's bernoulli_.
    sdpa = next(op.index for op in profile.ops if op.op == "aten.bernoulli_.float" and op.module == "blocks.1")
    around = [
        c for c, r in model.ranges.items() if r.first_op <= sdpa < r.end_op and model.calls[r.parent].fqn == "blocks.1"
    ]
    smallest = min(around, key=lambda c: model.ranges[c].end_op - model.ranges[c].first_op)
    assert [profile.calls[c].fqn for c in model.ranges[smallest].calls] == ["blocks.1.qkv", "blocks.1.proj"]
    _check(profile, {smallest: frozenset()}, exact=False)  # proj is an addmm
    # From the block's start, nested in the block's segment: the mask is drawn a third time,
    # in the block's recompute. (The block's segment alone is below the prediction at 8
    # points, for its four addmms.)
    block = next(c for c in profile.calls if c.fqn == "blocks.1")
    early = min((c for c in around if model.ranges[c].first_op == block.first_op), key=lambda c: model.ranges[c].end_op)
    assert (block.index, early) in model.nest_pairs and (block.index, smallest) not in model.nest_pairs
    _check(profile, {block.index: frozenset(), early: frozenset()}, exact=False, below=8)
    # The block's recompute runs the range to its end, recording its tape again: priced at
    # the recording's share of the tape's price, which the profile took on a block alone.
    frame = model.frames({block.index: frozenset(), early: frozenset()})[block.index]
    assert frame.stop >= model.ranges[early].end_op and frame.recorded_again == model.ranges[early].own_ops > 0
    measured = profile.overheads
    assert measured.range_record_op_ms is not None and measured.range_record_op_ms <= measured.range_op_ms
    # The pricing, with a share strictly below the whole, set here: under load the two can
    # measure equal, and the tape's price 0 (12-07, a CI run beside other work).
    costs = replace(measured, range_op_ms=0.02, range_record_op_ms=0.01)
    priced = SegmentModel(replace(profile, overheads=costs))
    machinery = costs.segment_ms + costs.saved_tensor_ms * frame.saves + costs.range_record_op_ms * frame.recorded_again
    assert priced.overhead_ms(block.index, frame=frame) == pytest.approx(machinery)
    # A profile made before the share was measured prices it at a whole record and replay.
    older = SegmentModel(replace(profile, overheads=replace(costs, range_record_op_ms=None)))
    upper = costs.segment_ms + costs.saved_tensor_ms * frame.saves + costs.range_op_ms * frame.recorded_again
    assert older.overhead_ms(block.index, frame=frame) == pytest.approx(upper) and upper > machinery


def test_a_range_s_replay_drops_the_attention_s_projection_when_attention_returns(gpt_profile):
    """tiny_gpt's attention splits the qkv projection into query, key and value views, which
    hold it until the function returns, after the output projection and dropout; only
    scaled_dot_product_attention reads them. The range's replay holds the projection until
    that torch call returns (its ops, a dozen on this CPU, end together), and the simulator
    says so; a profile made before the records this needs keeps the forward's lifetime."""
    from dataclasses import replace

    profile = gpt_profile
    model = SegmentModel(profile)
    block = next(c for c in profile.calls if c.fqn == "blocks.1")
    qkv, proj = (next(c for c in profile.calls if c.fqn == f"blocks.1.{name}") for name in ("qkv", "proj"))
    projection = next(s for s in profile.storages if s.producer is not None and qkv.first_op <= s.producer < qkv.end_op)
    assert projection.returned_to == block.index  # the Linear handed it to the block's own code
    between = [op for op in profile.ops[qkv.end_op : proj.first_op] if op.op != "aten.ones.default"]
    softmax = next(op for op in between if op.op == "aten._safe_softmax.default")
    attention = [op for op in between if op.torch_call_end == softmax.torch_call_end]
    assert {"aten.bmm.default", "aten.bernoulli_.float"} <= {op.op for op in attention}
    assert softmax.torch_call_end <= proj.first_op
    span = next(c for c, r in model.ranges.items() if r.first_op == qkv.first_op and r.end_op == proj.end_op)
    assert model.replay_drop(span, projection) == softmax.torch_call_end < proj.end_op <= projection.free_no_autograd
    _check(profile, {span: frozenset()}, exact=False)  # proj is an addmm
    older = replace(profile, ops=tuple(replace(op, torch_call_end=None) for op in profile.ops))
    assert SegmentModel(older).replay_drop(span, projection) is None
    before, now = live_series(SegmentModel(older), {span: frozenset()}), live_series(model, {span: frozenset()})
    assert min(a - b for a, b in zip(before, now)) == 0 and max(a - b for a, b in zip(before, now)) == projection.bytes


def test_what_own_code_keeps_on_its_module_is_dropped_by_a_replay_after_its_last_read():
    """The model's code keeps the ReLU's output on itself and reads it once: the forward's
    tensor lives on, but a range's replay runs the torch calls, not the assignment, so its copy
    goes after that read, where the simulator frees it."""
    profile = profile_model(small_spec("tests.models_for_tests:keeper_net", shape=(16,), batch_size=8), CPU, steps=1)
    model = SegmentModel(profile)
    relu = next(op for op in profile.ops if op.op == "aten.relu.default")
    kept = next(s for s in profile.storages if s.producer == relu.index)
    assert kept.returned_to == 0 and kept.free_no_autograd is None  # the model's code; the module keeps it
    ranges = [c for c, r in model.ranges.items() if r.first_op <= relu.index and relu.consumers[0] < r.end_op]
    assert ranges
    for call in ranges:
        assert model.replay_drop(call, kept) == profile.ops[relu.consumers[0]].torch_call_end
        _check(profile, {call: frozenset()}, exact=False)


def test_every_range_replays_under_autocast_within_its_prediction():
    """Under bf16 autocast the casts are own ops on the tape and replay without autocast (the
    forward's float32 matmul with autocast off would otherwise be cast again): each range of
    range_net stays at or below the simulator op by op, its peak within 2% of the prediction,
    and gradients, parameters and buffers equal the unmodified model's bit for bit. (Below the
    prediction at a few more points than in float32: recomputed casts that autograd saved are
    handed over on unpack, as the addmm's are.)"""
    profile = profile_model(
        small_spec(
            "tests.models_for_tests:range_net",
            shape=(16,),
            batch_size=8,
            precision="bf16-mixed",
            model_kwargs={"island": True},
        ),
        CPU,
        steps=1,
    )
    model = SegmentModel(profile)
    ranges = _ranges(model)
    assert len(ranges) >= 10 and any(op.op == "aten._to_copy.default" for op in profile.ops)
    # Of what ``up`` made only its output was handed on. Autocast's copies of its weight and
    # bias (kept in autocast's cache) and of its input are no code's: a replay frees them where
    # the profile saw them freed.
    up = next(c for c in profile.calls if c.fqn == "up")
    copies = [s for s in profile.storages if s.producer is not None and up.first_op <= s.producer < up.end_op]
    assert [s.returned_to for s in copies].count(None) == len(copies) - 1
    for name, call in sorted(ranges.items()):
        schedule = plan_schedule(profile, {call: frozenset()}, model=model)
        report = run_apply(schedule, CPU, steps=2, check=True, timeline=True)
        predicted = live_series(model, {call: frozenset()})
        assert len(report.timeline) == len(predicted), name
        assert all(measured <= live for measured, live in zip(report.timeline, predicted)), name
        assert report.measured_peak_bytes <= schedule.predicted.peak_bytes <= 1.02 * report.measured_peak_bytes, name
        assert report.check.mode == "exact" and report.check.ok, (name, report.check)


def test_an_op_range_is_priced_on_the_model_s_own_code(range_net_profile, monkeypatch):
    """The module with the most own ops among those holding ranges runs alone: its forward, and
    under plain checkpoint and as one range over its forward, the forward alone and forward and
    backward. Range minus checkpoint, per own op, is the tape's price, and of the forwards
    alone its recording's, in the profile's time: the forward against the call's wall time
    says how fast the machine runs now (the timings themselves are the benchmarks' business:
    here they are given). The rest of the profile's prices stay. Where
    only the model itself holds ranges (range_net) or the module cannot run alone, the generic
    prices stay (with a warning for the second)."""
    from dataclasses import astuple, replace

    from monet_cli.profiler import probe
    from monet_cli.workload.resolve import Overrides, resolve_model_spec

    spec = resolve_model_spec("configs/gpt.yaml", Overrides(batch_size=2))
    profile = profile_model(spec, CPU, steps=1)
    found = probe._probe(SegmentModel(profile))
    block = found.range.within
    assert block.startswith("blocks.") and found.range.own_ops >= probe.MIN_OWN_OPS
    assert profile.calls[found.call].fqn == block and found.range.calls[:3] == (
        f"{block}.ln1",
        f"{block}.qkv",
        f"{block}.proj",
    )
    assert probe._probe(SegmentModel(range_net_profile)) is None
    workload = build_workload(spec, CPU)
    times = probe._timed(workload, found.range)  # the range replays as recorded
    assert times.forward_ms > 0 and all(math.isfinite(ms) for ms in astuple(times))

    wall = profile.calls[found.call].time_ms
    # The machine runs twice as slow as in the profile's steps: the differences count half.
    given = probe._Times(
        forward_ms=2 * wall, range_over_checkpoint_ms=2 * 3.0, range_forward_over_checkpoint_ms=2 * 1.0
    )
    monkeypatch.setattr(probe, "_timed", lambda *_args: given)
    measured = probe.probe_overheads(workload, profile)
    assert measured.range_op_ms == pytest.approx(3.0 / found.range.own_ops, abs=1e-6)
    assert measured.range_record_op_ms == pytest.approx(1.0 / found.range.own_ops, abs=1e-6)
    assert measured == replace(
        profile.overheads, range_op_ms=measured.range_op_ms, range_record_op_ms=measured.range_record_op_ms
    )

    def fails(*_args):
        raise RuntimeError("needs its parent")

    monkeypatch.setattr(probe, "_timed", fails)
    with pytest.warns(UserWarning, match="op ranges keep their generic price: timing 'blocks.* alone failed"):
        assert probe.probe_overheads(workload, profile) == profile.overheads


def test_a_mode_a_call_pushes_in_its_pre_hook_stays_on_top(range_net_profile):
    """The recorder steps off the mode stack while a call runs only when it is on top: a mode a
    hook pushed above it (a user's op counter, say, put before the range's hooks) stays, sees
    the call's ops as without the schedule, and the gradients equal the unmodified model's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from monet_cli.runtime.executor import apply_schedule

    class Counting(TorchDispatchMode):
        seen = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Counting.seen += 1
            return func(*args, **(kwargs or {}))

    model = SegmentModel(range_net_profile)
    call = _ranges(model)["<model>[3:14]"]
    schedule = plan_schedule(range_net_profile, {call: frozenset()}, model=model)
    assert "bn" in schedule.segments[0].calls
    grads, seen = [], []
    modes: list[TorchDispatchMode] = []
    for scheduled in (False, True):
        workload = build_workload(_range_net_spec(), CPU)
        if scheduled:  # the hooks below are not the profile's, which the check would refuse
            apply_schedule(workload.model, schedule, check_fingerprint=False)
        workload.model.bn.register_forward_pre_hook(lambda *_: modes.append(Counting().__enter__()), prepend=True)
        workload.model.bn.register_forward_hook(lambda *_: modes.pop().__exit__(None, None, None))
        torch.manual_seed(0)
        workload.zero_grad()
        Counting.seen = 0
        workload.step(lambda phase, _loss: seen.append(Counting.seen) if phase == "backward" else None)
        grads.append([p.grad.clone() for p in workload.model.parameters()])
    assert seen[0] > 0 and seen[1] == seen[0]  # in the forward
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_range_refuses_another_op_sequence_and_leaves_nothing_behind(range_net_profile, tmp_path):
    model = SegmentModel(range_net_profile)
    schedule = plan_schedule(range_net_profile, {_ranges(model)["<model>[13:21]"]: frozenset()})
    save_schedule(schedule, tmp_path / "s.yaml")
    loaded = load_schedule(tmp_path / "s.yaml")
    assert loaded == schedule and loaded.ranges == loaded.segments
    assert loaded.segments[0].members == ("", "act", "down", "head") and loaded.segments[0].skip == 1
    assert "own_ops: 3" in (tmp_path / "s.yaml").read_text()

    workload = build_workload(_range_net_spec(extra=True), CPU)
    monet_cli.apply(workload.model, schedule, check_fingerprint=False)
    args, kwargs = workload.call_args()
    with torch.no_grad():
        workload.model(*args, **kwargs)  # nothing is saved without grad: no frame opens
    with pytest.raises(FingerprintError, match="ran 4 of the module's own ops where the profile saw 3"):
        workload.model(*args, **kwargs)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    assert _get_current_dispatch_mode() is None


@pytest.mark.parametrize(("numpy", "by_torch_calls"), [(False, True), (True, False)])
def test_a_range_tapes_torch_calls_after_its_first_forward_unless_it_cannot_follow_them(
    numpy, by_torch_calls, monkeypatch
):
    """A range's first forward writes its tape op by op, as the profile counted them; the later
    ones write the module's torch calls, unless the first showed the tape could not follow
    them: here a torch call's result goes on through a numpy array, so it stays op by op.
    Either way the steps hold the simulator and the unmodified model's results."""
    from monet_cli.runtime.ranges import RangeSegment

    installed: list[RangeSegment] = []
    install = RangeSegment.install
    monkeypatch.setattr(RangeSegment, "install", lambda self: (installed.append(self), install(self))[1])
    profile = profile_model(_range_net_spec(numpy=numpy), CPU, steps=1)
    model = SegmentModel(profile)
    largest = max(_ranges(model).values(), key=lambda c: model.ranges[c].own_ops)
    schedule = _check(profile, {largest: frozenset()}, exact=False)
    ours = [r for r in installed if r.decision == schedule.segments[0]]
    assert len(ours) == 2 and all((r.first_torch_calls is not None) == by_torch_calls for r in ours)
    assert all(r.ops_only != by_torch_calls for r in ours)


def test_a_range_replays_tuple_indexes_as_tuples():
    """``h[:, None, a:]`` passes its index as a tuple; replayed as a list it would be another
    index (PyTorch warns that it will be). The replay keeps each argument's container type."""
    import warnings

    spec = small_spec("tests.models_for_tests:indexing_net", shape=(16,), batch_size=8)
    profile = profile_model(spec, CPU, steps=1)
    model = SegmentModel(profile)
    largest = max(_ranges(model).values(), key=lambda c: model.ranges[c].own_ops)
    assert model.ranges[largest].own_ops >= 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _check(profile, {largest: frozenset()})
    assert not [w for w in caught if "non-tuple sequence" in str(w.message)]


def test_a_range_refuses_own_code_whose_torch_calls_change(range_net_profile):
    """Own code that takes another path after the first forward is caught at the torch calls."""
    from torch.overrides import _get_current_function_mode

    model = SegmentModel(range_net_profile)
    schedule = plan_schedule(range_net_profile, {_ranges(model)["<model>[13:21]"]: frozenset()})
    workload = build_workload(_range_net_spec(), CPU)
    monet_cli.apply(workload.model, schedule)
    workload.step()
    workload.zero_grad()
    workload.model.extra = True
    with pytest.raises(FingerprintError, match="its own code made 4 torch calls where its first forward made 3"):
        workload.step()
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None
    assert _get_current_function_mode() is None


@pytest.mark.parametrize(
    ("name", "reason", "marked"),
    [
        ("function_net", "calls a custom autograd Function", [("aten.mul.Tensor", ""), ("aten.mul.Tensor", "block")]),
        ("generator_net", "draws random numbers from a generator it passes", [("aten.rand.generator", "")]),
    ],
)
def test_own_code_a_replay_cannot_repeat_is_in_no_range(name, reason, marked, tmp_path):
    """A range replays its own code's torch calls: a custom Function would run as its ops
    (autograd saves other tensors than the Function did: torch's CheckpointError in backward),
    and a generator passed to a random op would draw other numbers (other gradients, silently:
    checkpoint restores the default RNG only). The profile marks those ops and offers no range
    holding them; a schedule from a profile made before that stops in the range's first
    forward with monet's error, leaving nothing behind."""
    import dataclasses

    profile = profile_model(small_spec(f"tests.models_for_tests:{name}", shape=(16,), batch_size=8), CPU, steps=1)
    ops = [op for op in profile.ops if op.unreplayable]
    assert [(op.op, op.module) for op in ops] == marked
    assert all(op.unreplayable == reason for op in ops)
    owners = {call.fqn: call.index for call in profile.calls}  # whose own code each marked op is
    owners[""] = 0
    model = SegmentModel(profile)
    ranges = [model.ranges[c] for c in model.segments if c in model.ranges]
    assert ranges
    assert not [r for r in ranges for op in ops if r.parent == owners[op.module] and r.first_op <= op.index < r.end_op]
    save_profile(profile, tmp_path / "p.yaml")  # the reasons survive the file; inspect lists the ops
    shown = json.loads(CliRunner().invoke(app, ["inspect", str(tmp_path / "p.yaml"), "--json"]).stdout)
    assert [(row["op"], row["reason"]) for row in shown["unreplayable_ops"]] == [(op, reason) for op, _ in marked]

    unmarked = dataclasses.replace(profile, ops=tuple(dataclasses.replace(op, unreplayable="") for op in profile.ops))
    old = SegmentModel(unmarked)
    holding = next(
        c for c in old.segments if c in old.ranges and old.ranges[c].first_op <= ops[0].index < old.ranges[c].end_op
    )
    schedule = plan_schedule(unmarked, {holding: frozenset()}, model=old)
    with pytest.raises(FingerprintError, match=f"its own code {reason}, which a range cannot replay"):
        run_apply(schedule, CPU, steps=1, check=False)
    assert torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def test_a_module_call_running_a_custom_autograd_function_is_checkpointed():
    """Checkpoint re-runs a module's forward, Function and all: the call stays a segment."""
    profile = profile_model(small_spec("tests.models_for_tests:function_net", shape=(16,), batch_size=8), CPU, steps=1)
    block = next(call for call in profile.calls if call.fqn == "block")
    assert block.checkpointable
    _check(profile, {block.index: frozenset()})


def test_solve_counts_ranges_and_inspect_and_validate_show_them(range_net_profile, tmp_path):
    save_profile(range_net_profile, tmp_path / "p.yaml")
    runner = CliRunner()
    floor = Planner(SegmentModel(range_net_profile), variants=False).minimum_peak(time_limit_s=10, workers=1, seed=0)
    result = runner.invoke(
        app,
        [
            "solve",
            str(tmp_path / "p.yaml"),
            "--budget",
            str(floor.peak_bytes),
            "--no-variants",
            "--output",
            str(tmp_path / "s.yaml"),
            "--json",
            "--workers",
            "1",
        ],
    )
    assert result.exit_code == 0, result.output
    solved = json.loads(result.stdout)
    schedule = load_schedule(tmp_path / "s.yaml")
    assert solved["ranges"] == len(schedule.ranges) >= 1
    result = runner.invoke(app, ["inspect", str(tmp_path / "s.yaml"), "--json"])
    segment = next(s for s in json.loads(result.stdout)["segments"] if s["within"] is not None)
    assert segment["calls"] and segment["module"].startswith("<model>[")
    table = runner.invoke(app, ["inspect", str(tmp_path / "s.yaml")], env={"COLUMNS": "48"}).stdout
    unwrapped = "".join(line.split("│")[1].strip() for line in table.splitlines() if line.count("│") > 2)
    folded = [segment["module"], *segment["calls"]]  # folded onto the next lines, not cut to "<mod…"
    assert all(name in unwrapped for name in folded), table
    result = runner.invoke(app, ["inspect", str(tmp_path / "p.yaml"), "--json"])
    assert json.loads(result.stdout)["ranges"] == len(SegmentModel(range_net_profile).ranges)
    result = runner.invoke(app, ["validate", str(tmp_path / "s.yaml")])
    assert result.exit_code == 0, result.output


def test_a_module_called_from_outside_the_model_s_tree_is_in_no_range():
    """transformers' LLaMA calls its rotary embedding through one module object that no model
    registers: a schedule cannot name it by path, so no range holds it (``monet apply`` refused
    such ranges as "not a module of this model"), and the range price is timed on a block
    without one (timing that block alone failed, and left the generic price)."""
    import warnings

    from monet_cli.profiler.probe import _probe

    spec = small_spec("tests.models_for_tests:outside_call_net", shape=(16,), batch_size=8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        profile = profile_model(spec, CPU, steps=1)
    assert not [w for w in caught if "op ranges keep their generic price" in str(w.message)]
    model = SegmentModel(profile)
    outside = [c.index for c in profile.calls if not c.registered]
    assert len(outside) == 2 and all(profile.calls[c].parent == 1 for c in outside)
    assert not [r for r in model.ranges.values() if set(r.calls) & set(outside)]
    assert [r for r in model.ranges.values() if r.parent == 1]  # the block keeps its other ranges
    assert profile.calls[_probe(model).call].fqn == "1"
    plan = {c: frozenset() for c, r in model.ranges.items() if r.parent == 1}
    checked = run_apply(plan_schedule(profile, plan, model=model), CPU, steps=2, check=True).check
    assert checked.grads_match and checked.params_match and checked.buffers_match
