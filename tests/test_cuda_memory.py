"""What a CUDA profile counts, checked without a GPU: the caching allocator's rounding as pure
functions, the meter's block sizes on fake CUDA tensors, and op workspaces in the simulator
and the solver's linear model (injected into a CPU profile)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from monet_cli.core.allocator import (
    MIN_BLOCK_BYTES,
    CachingAllocator,
    cuda_block_bytes,
    leaves_blocks_unsplit,
    max_split_bytes,
    non_split_rounding_bytes,
    roundup_divisions,
    same_counting,
)
from monet_cli.core.codec import to_data
from monet_cli.core.profile import load_profile, profile_from_data
from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import peak_breakdown, simulate
from monet_cli.core.solver.linear import LinearMemory
from monet_cli.core.solver.search import Planner
from monet_cli.errors import FileFormatError, UsageError
from monet_cli.runtime.meter import LiveStorageMeter, cuda_allocated_bytes


@pytest.mark.parametrize(
    ("nbytes", "block"),
    [
        (0, 0),
        (1, 512),
        (511, 512),
        (512, 512),
        (513, 1024),
        (4096, 4096),
        (2**20 + 1, 2**20 + 512),
    ],
)
def test_requests_round_up_to_512_byte_blocks(nbytes, block):
    assert cuda_block_bytes(nbytes) == block


@pytest.mark.parametrize("divisions", [2, 4, 8])
def test_power2_divisions_round_to_the_next_step_between_powers_of_two(divisions):
    for nbytes in [MIN_BLOCK_BYTES * divisions + 1, 1_200_000, 2**24, 2**24 + 1, 3 * 2**23 - 7]:
        floor = 1 << (nbytes.bit_length() - 1)
        step = floor // divisions
        block = cuda_block_bytes(nbytes, roundup_power2_divisions=divisions)
        assert nbytes <= block < nbytes + step and block % step == 0, (nbytes, block)
    # Small requests keep the 512-byte rule; a power of two is its own block.
    assert cuda_block_bytes(1000, roundup_power2_divisions=divisions) == 1024
    assert cuda_block_bytes(2**22, roundup_power2_divisions=divisions) == 2**22


def test_the_alloc_conf_setting_is_read_or_refused():
    assert roundup_divisions("") == 0
    assert roundup_divisions("expandable_segments:True,roundup_power2_divisions:4") == 4
    with pytest.raises(ValueError, match="only one number"):
        roundup_divisions("roundup_power2_divisions:[256:1,512:2,>:4]")


MiB = 1 << 20
DATA = Path(__file__).parent / "data"


def test_the_allocator_keeps_a_large_block_whole_when_1_mib_or_less_would_remain():
    native = CachingAllocator()
    native.free(native.malloc(20 * MiB))  # a 20 MiB segment, cached
    native.malloc(19 * MiB + 512)  # leaves 1 MiB - 512 B
    assert native.allocated_bytes == 20 * MiB  # counted whole
    native.malloc(13 * MiB + 512)  # a new segment rounded to 14 MiB: 1 MiB - 512 B would remain
    assert native.allocated_bytes == 34 * MiB
    small = native.malloc(1000)  # rounded to 1024 B; the small pool splits down to 512 B
    assert native.allocated_bytes == 34 * MiB + 1024
    native.free(small)
    assert native.allocated_bytes == 34 * MiB and native.peak_bytes == 34 * MiB + 1024


def test_a_large_request_takes_the_smallest_cached_block_that_holds_it():
    allocator = CachingAllocator()
    blocks = [allocator.malloc(n * MiB) for n in (12, 16, 30)]  # segments of 12, 16 and 30 MiB
    for block in blocks:
        allocator.free(block)
    allocator.malloc(15 * MiB + 512)  # the 16 MiB block; 1 MiB - 512 B would remain
    assert allocator.allocated_bytes == 16 * MiB
    allocator.malloc(14 * MiB)  # the 30 MiB block, split: 16 MiB stay cached
    assert allocator.allocated_bytes == 30 * MiB


def test_with_max_split_size_a_large_block_at_or_over_it_is_never_split():
    """PyTorch's ``get_free_block`` and ``should_split`` under ``max_split_size_mb:128``: a block
    of 128 MiB or more serves no smaller request, serves a larger one whole only if less than
    20 MiB (``max_non_split_rounding_mb``) larger, and is never split."""
    capped, native = CachingAllocator(max_split_bytes=128 * MiB), CachingAllocator()
    for allocator in (capped, native):
        allocator.free(allocator.malloc(160 * MiB))  # a 160 MiB segment, cached
    taken = capped.malloc(150 * MiB)  # 160 < 150 + 20: the cached block, whole
    assert capped.allocated_bytes == 160 * MiB
    assert native.malloc(150 * MiB) and native.allocated_bytes == 150 * MiB  # split: 10 MiB stay cached
    capped.free(taken)
    capped.malloc(100 * MiB)  # under 128 MiB: not from the 160 MiB block, a new segment
    assert capped.allocated_bytes == 100 * MiB
    capped.malloc(140 * MiB)  # 160 >= 140 + 20: a new segment again
    assert capped.allocated_bytes == 240 * MiB
    capped.malloc(141 * MiB)  # 160 < 141 + 20: the cached block, whole
    assert capped.allocated_bytes == 400 * MiB
    wider = CachingAllocator(max_split_bytes=128 * MiB, non_split_rounding_bytes=64 * MiB)
    wider.free(wider.malloc(200 * MiB))
    wider.malloc(140 * MiB)  # within 64 MiB: the 200 MiB block, whole
    assert wider.allocated_bytes == 200 * MiB


def test_the_split_settings_are_read_from_the_allocator_conf_and_a_profile_refuses_a_bad_one(h200):
    assert max_split_bytes("") is None and non_split_rounding_bytes("") == 20 * MiB
    conf = "expandable_segments:False,max_split_size_mb:128,max_non_split_rounding_mb:64"
    assert (max_split_bytes(conf), non_split_rounding_bytes(conf)) == (128 * MiB, 64 * MiB)
    assert not same_counting("", "max_split_size_mb:128")
    assert not same_counting("max_split_size_mb:128", "max_split_size_mb:128,max_non_split_rounding_mb:64")
    assert same_counting("max_split_size_mb:128", "max_split_size_mb:128,expandable_segments:False")
    data = to_data(h200)
    data["device"]["alloc_conf"] = "max_split_size_mb:lots"
    with pytest.raises(FileFormatError, match="max_split_size_mb:lots"):
        profile_from_data(data, source="edited.yaml")


def test_the_simulator_replays_blocks_under_the_profile_s_max_split_size(h200):
    """The same H200 step replayed under ``max_split_size_mb:21``: blocks of 21 MiB or more stay
    whole, and the predicted peak is the replay under those rules, not the defaults'."""
    default = simulate(h200, {})
    capped_profile = replace(h200, device=replace(h200.device, alloc_conf="max_split_size_mb:21"))
    capped = simulate(capped_profile, {})
    assert capped.requested_peak_bytes == default.requested_peak_bytes
    assert capped.peak_bytes > default.peak_bytes + 32 * MiB  # 3103.0 against 3061.0 MiB


def _every_block_split(profile):
    """The profile as if made with expandable segments, where the allocator splits every block."""
    return replace(profile, device=replace(profile.device, alloc_conf="expandable_segments:True"))


@pytest.fixture(scope="module")
def h200():
    """resnet50 (batch 64, bf16-mixed) profiled on an H200 with PyTorch's default allocator."""
    return load_profile(DATA / "h200-resnet50-bf16.profile.yaml")


@pytest.fixture(scope="module")
def planned_by_requests(h200):
    """80% of the H200 profile's peak, and the fastest plan whose requests fit it (solved as if
    every block were split)."""
    budget = int(h200.baseline.peak_bytes * 0.8)
    planner = Planner(SegmentModel(_every_block_split(h200)))
    return budget, planner.solve(budget, time_limit_s=60, workers=2, seed=0, relative_gap=0.01)


def test_the_simulator_counts_the_allocator_s_blocks_on_a_cuda_profile(h200):
    """The H200 step measured 18.3 MiB more than the profile's requests add up to; the simulated
    peak, the allocator's blocks replayed, misses less than 2 MiB. Profiled with expandable
    segments it would be the requests' sum."""
    profile = h200
    assert profile.device.alloc_conf == ""
    measured = profile.baseline.peak_bytes
    simulated = simulate(profile, {})
    assert measured - simulated.requested_peak_bytes > 18 * MiB
    assert 0 <= measured - simulated.peak_bytes < 2 * MiB
    breakdown = peak_breakdown(SegmentModel(profile), {})
    assert breakdown["unsplit"] == simulated.peak_bytes - simulated.requested_peak_bytes
    assert sum(breakdown.values()) == simulated.peak_bytes
    assert simulate(_every_block_split(profile), {}).peak_bytes == simulated.requested_peak_bytes


def test_the_solver_plans_with_the_allocator_s_blocks(h200, planned_by_requests):
    """At 80% of the H200 profile's peak, the fastest plan whose requests fit the budget is over it
    once the allocator's blocks are counted. The solve loop lowers the linear model's budget by
    what the blocks added, until they fit too, and claims no bound for the answer. Its added time
    stays near that of the plan counting requests alone, a lower bound (stopping at the first
    answer the blocks put over, it was 5.8 times as much)."""
    profile, (budget, summed) = h200, planned_by_requests
    assert summed.result.peak_bytes <= budget < simulate(profile, summed.plan, variants=summed.variants).peak_bytes
    outcome = Planner(SegmentModel(profile)).solve(budget, time_limit_s=60, workers=2, seed=0, relative_gap=0.01)
    assert outcome.result.requested_peak_bytes < outcome.result.peak_bytes <= budget
    assert outcome.result == simulate(profile, outcome.plan, variants=outcome.variants)
    assert (outcome.status, outcome.method, outcome.bound_ms) == ("FEASIBLE", "cp-sat", None)
    assert outcome.result.added_ms < 1.2 * summed.result.added_ms


def test_the_allocator_settings_tell_whether_blocks_stay_unsplit():
    assert leaves_blocks_unsplit("") and leaves_blocks_unsplit("max_split_size_mb:128,expandable_segments:False")
    assert not leaves_blocks_unsplit("max_split_size_mb:128,expandable_segments:True")
    assert not leaves_blocks_unsplit("backend:cudaMallocAsync")


def test_the_meter_counts_cuda_storages_at_their_block_size(monkeypatch):
    """Fake CUDA tensors have real storages without a GPU: enough to check the meter's sizes."""
    meter = LiveStorageMeter("cuda")
    with FakeTensorMode():
        tensors = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (513, 0, 1)]
        cpu = torch.empty(513, dtype=torch.uint8)  # as attention's dropout seed: not the GPU's memory
        meter.register([*tensors, cpu])
        # What a CUDA measurement subtracts for a model kept beside it: a view adds nothing.
        beside = cuda_allocated_bytes([*tensors, tensors[0][:10], cpu])
    assert beside == 1024 + 0 + 512
    assert meter.current_bytes == 1024 + 0 + 512 + 0
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "roundup_power2_divisions:[256:1]")
    with pytest.raises(UsageError), FakeTensorMode():
        LiveStorageMeter("cuda").register([torch.empty(1, device="cuda")])


# -- workspaces ------------------------------------------------------------------------------


def _with_workspaces(profile):
    """The profile as if each convolution (forward and backward) took workspace while it ran."""
    ops = tuple(
        replace(op, workspace_bytes=4096 * (1 + op.index % 3)) if "convolution" in op.op else op for op in profile.ops
    )
    backward = tuple(replace(op, workspace_bytes=8192) if "convolution" in op.op else op for op in profile.backward)
    return replace(profile, ops=ops, backward=backward)


def test_workspaces_are_live_while_their_op_runs(skip_cnn_profile):
    plain, busy = skip_cnn_profile, _with_workspaces(skip_cnn_profile)
    assert any(op.workspace_bytes for op in busy.ops) and any(op.workspace_bytes for op in busy.backward)

    def after_each_op(profile) -> np.ndarray:
        linear = LinearMemory(SegmentModel(profile))
        at_positions = np.array([len(p.key) == 2 and p.key[0] >= 0 for p in linear.points])  # not in bursts
        return linear.live({})[at_positions]

    before, after = after_each_op(plain), after_each_op(busy)
    workspace = [op.workspace_bytes for op in (*busy.ops, *busy.backward)]
    assert (after - before).tolist() == workspace
    assert simulate(busy, {}).peak_bytes == max(after)


def test_recompute_bursts_take_workspace_and_the_linear_model_agrees(skip_cnn_profile):
    """Re-run convolutions take their workspace in the burst, and only while they run; every row
    the solver uses still equals whole-step simulations, and its optimum is the enumerated one."""
    from monet_cli.core.solver.enumerate import all_plans

    profile = _with_workspaces(skip_cnn_profile)
    model = SegmentModel(profile)
    linear, plain = LinearMemory(model), LinearMemory(SegmentModel(skip_cnn_profile))
    n = len(linear.points)
    rerun_ws = []
    for call, seg in model.segments.items():
        bare = linear.live({call: frozenset()})
        assert (linear.seg_delta[call].dense(n) == bare - linear.base).all(), seg.fqn
        mask = linear.active_mask({call: frozenset()})
        assert (linear.predict({call: frozenset()})[mask] == bare[mask]).all()
        assert bare.max() == simulate(profile, {call: frozenset()}, model=model).peak_bytes
        for i in seg.candidates:
            keep = linear.live({call: frozenset({i})}) - bare
            assert (linear.keep_delta[(call, i)].dense(n) == keep).all(), (seg.fqn, i)
        extra = bare - plain.live({call: frozenset()})
        for j, point in enumerate(linear.points):
            if point.burst_of == call:  # the point after re-run op ``key[-2]`` allocated its outputs
                assert extra[j] == profile.ops[point.key[-2]].workspace_bytes
                rerun_ws.append(extra[j])
    assert any(rerun_ws)
    scored = [(simulate(profile, p, model=model), p) for p in all_plans(model)]
    lowest = min(r.peak_bytes for r, _ in scored)
    minimum = Planner(model).minimum_peak(time_limit_s=20, workers=1, seed=0)
    assert minimum.peak_bytes == lowest
    assert sum(peak_breakdown(model, minimum.plan).values()) == lowest


def test_inspect_takes_a_cuda_profile_whose_schedule_predicted_the_requests_sum(h200):
    """Schedules solved before the simulator replayed the allocator's blocks predicted the sum."""
    from monet_cli.cli.inspect_cmd import check_schedule_matches
    from tests.schedules_for_tests import plan_schedule

    profile = h200
    schedule = plan_schedule(profile, {})
    result = simulate(profile, {})
    for predicted in (result.peak_bytes, result.requested_peak_bytes):
        check_schedule_matches(replace(schedule, predicted=replace(schedule.predicted, peak_bytes=predicted)), profile)
    with pytest.raises(UsageError, match="does not reproduce"):
        check_schedule_matches(replace(schedule, predicted=replace(schedule.predicted, peak_bytes=1)), profile)


def test_apply_warns_where_the_allocator_counts_blocks_otherwise(h200, monkeypatch):
    """A CUDA schedule carries its profile's allocator settings; applied under settings that
    count blocks otherwise (expandable segments, a split limit) it warns, under equivalent ones it
    does not."""
    import warnings

    from monet_cli.runtime.executor import apply_schedule
    from tests.schedules_for_tests import plan_schedule

    schedule = plan_schedule(h200, {})  # no decisions: any model takes it
    assert schedule.predicted.alloc_conf == ""
    for conf, warns in (
        ("expandable_segments:True", True),
        ("max_split_size_mb:512", True),
        ("expandable_segments:False", False),
    ):
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", conf)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            apply_schedule(torch.nn.Linear(2, 2), schedule, check_fingerprint=False)
        assert any("counts blocks otherwise" in str(w.message) for w in caught) == warns, conf
    assert plan_schedule(_every_block_split(h200), {}).predicted.alloc_conf == "expandable_segments:True"


def test_no_plan_within_a_lowered_budget_is_not_called_infeasible(h200, planned_by_requests, monkeypatch):
    """Once the allocator's blocks lowered the linear model's budget, a round CP-SAT proves
    infeasible says nothing of the budget itself: the solve ends UNKNOWN (exit 4: raise the time
    limit), not INFEASIBLE (exit 3: below the smallest peak)."""
    from monet_cli.core.solver import search
    from monet_cli.core.solver.cpsat import CpResult

    budget, summed = planned_by_requests
    planner = Planner(SegmentModel(h200))
    rounds = iter(
        [
            CpResult(
                status="UNKNOWN",
                plan=None,
                objective=None,
                bound=None,
                wall_s=0.0,
                refused=(summed.plan, summed.variants),
            ),
            CpResult(status="INFEASIBLE", plan=None, objective=None, bound=None, wall_s=0.0),
        ]
    )
    monkeypatch.setattr(search, "solve_model", lambda cp, variables, **kwargs: next(rounds))
    monkeypatch.setattr(planner, "_warm_start", lambda *args: ("none", None, ({}, frozenset())))  # nothing fits
    lowered = []
    outcome = planner.solve(budget, time_limit_s=60, workers=1, seed=0, report=lowered.append)
    assert any("requests planned within" in line for line in lowered)
    assert (outcome.status, outcome.plan) == ("UNKNOWN", None)
