"""Operator variants: where they apply, what the profile measures, what the simulator and
solver make of them, and that a schedule running them holds its peak and its tolerance."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from conftest import small_spec
from typer.testing import CliRunner

from monet_cli.cli.app import app
from monet_cli.core.plan import variants_of
from monet_cli.core.profile import save_profile
from monet_cli.core.schedule import VariantDecision, consistency_problem, with_content_hash
from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import simulate
from monet_cli.core.solver.linear import LinearMemory
from monet_cli.core.solver.search import Planner
from monet_cli.core.variants import find_sites, with_variants
from monet_cli.profiler.run import profile_model
from monet_cli.runtime.compare import run_apply
from monet_cli.runtime.variants import install_on, variant_ready
from tests.schedules_for_tests import plan_schedule

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def chain_profile():
    return profile_model(
        small_spec("tests.models_for_tests:bn_chain_net", shape=(3, 16, 16), batch_size=4), CPU, steps=1
    )


def test_sites_are_the_batchnorms_feeding_an_activation_feeding_convolutions(chain_profile):
    sites = [(v.impl, v.modules) for v in chain_profile.variants]
    # The third BatchNorm's ReLU feeds a pooling, not a convolution: no site.
    assert sites == [("bn_output", ("1", "2", "3")), ("bn_output", ("4", "5", "6"))]
    assert [s.ops for s in find_sites(chain_profile)] == [v.ops for v in chain_profile.variants]


def test_the_profile_measures_what_each_variant_keeps(chain_profile):
    relu, relu6 = chain_profile.variants
    # ReLU: PyTorch keeps the BatchNorm's input and the ReLU output, the variant the BatchNorm
    # output alone (and the batch statistics, a few bytes). ReLU6 also keeps its input: 3 -> 1.
    activation = 4 * 8 * 16 * 16 * 4
    assert relu.native_saved_bytes - relu.saved_bytes == activation
    assert relu6.native_saved_bytes - relu6.saved_bytes == 2 * activation
    assert relu.saved_bytes < activation * 1.01


def test_the_rewritten_profile_predicts_the_measured_peak_and_the_tolerance_holds(chain_profile):
    every = frozenset(range(len(chain_profile.variants)))
    schedule = plan_schedule(chain_profile, {}, peaks=1, variants=every)
    assert schedule.predicted.peak_bytes < chain_profile.baseline.peak_bytes
    report = run_apply(schedule, CPU, steps=1, check=True, timeline=True)
    assert report.measured_peak_bytes == schedule.predicted.peak_bytes
    from monet_cli.core.solver.linear import live_series

    # Op by op through the forward; backward runs other ops than the profile's (the rebuilds).
    forward = len(chain_profile.ops)
    assert report.timeline[:forward] == live_series(SegmentModel(chain_profile), {}, every)[:forward]
    check = report.check
    assert check.mode == "variants" and check.ok and check.buffers_match, check
    assert check.variants == ("1", "4")
    # Not bit-exact (the BatchNorm input is rebuilt), yet far inside the stated tolerance.
    assert 0 < check.max_relative_diff < schedule.tolerance()[1]


def test_the_step_peaking_in_a_variant_backward_is_predicted_to_the_byte():
    """Wide channels on a 2x2 image: the step peaks while a variant BatchNorm's backward runs,
    where the rebuilt input and the zero mean it passes PyTorch's kernel are live (the per-channel
    tensors of that backward were once missed: 16 B a channel on mobilenet_v2)."""
    profile = profile_model(
        small_spec("tests.models_for_tests:bn_chain_net", shape=(3, 2, 2), batch_size=4, model_kwargs={"width": 64}),
        CPU,
        steps=1,
    )
    for chosen in ({0}, {1}, {0, 1}):
        schedule = plan_schedule(profile, {}, variants=frozenset(chosen))
        report = run_apply(schedule, CPU, steps=1, check=True)
        assert report.measured_peak_bytes == schedule.predicted.peak_bytes, chosen
        assert report.check.ok, chosen
    # Here the two variants raise the peak above PyTorch's (the rebuilds cost more than they
    # save): a case for the solver to leave alone.
    assert schedule.predicted.peak_bytes > profile.baseline.peak_bytes


def test_variant_rows_add_up_exactly_in_the_linear_model(resnet18_profile):
    model = SegmentModel(resnet18_profile)
    offered = tuple(range(len(resnet18_profile.variants)))
    # The stem's max-pooling, and bn1 -> relu -> conv2 in each of the 8 BasicBlocks, less any
    # whose weight the profiled training steps brought near zero (batch 2: layer3's statistics
    # cover 8 values; whether one crosses depends on the build's rounding).
    impls = [v.impl for v in resnet18_profile.variants]
    assert impls.count("maxpool_offsets") == 1 and 6 <= impls.count("bn_output") <= 8
    linear = LinearMemory(model, variants=offered)
    active = linear.active_mask({})  # recompute bursts of unchosen segments do not happen
    for chosen in ({0}, {3, 5}, set(offered)):
        chosen = frozenset(chosen)
        np.testing.assert_array_equal(linear.predict({}, chosen)[active], linear.live({}, chosen)[active])
        assert (linear.live({}, chosen)[active] < linear.live({})[active]).any()


def test_a_variant_is_never_run_with_a_segment_that_moves_its_tensors(resnet18_profile):
    model = SegmentModel(resnet18_profile)
    site = resnet18_profile.variants[0]
    block = next(c.index for c in resnet18_profile.calls if c.fqn == site.module.rsplit(".", 1)[0])
    assert block in model.variant_conflicts[0]
    with pytest.raises(ValueError, match="change the same tensors"):
        simulate(resnet18_profile, {block: frozenset()}, model=model, variants=frozenset({0}))


def test_the_solver_chooses_variants_jointly_and_only_when_allowed(chain_profile):
    model = SegmentModel(chain_profile)
    every = frozenset(range(len(chain_profile.variants)))
    budget = simulate(chain_profile, {}, model=model, variants=every).peak_bytes
    assert budget < chain_profile.baseline.peak_bytes
    outcome = Planner(model).solve(budget, time_limit_s=20, workers=1, seed=0)
    assert outcome.status == "OPTIMAL" and outcome.variants and outcome.result.peak_bytes <= budget
    for index in outcome.variants:
        assert not set(model.variant_conflicts[index]) & set(outcome.plan)
    # Here the variants reach a peak checkpointing alone cannot (each module is its own call).
    checkpointing_only = Planner(model, variants=False).solve(budget, time_limit_s=20, workers=1, seed=0)
    assert checkpointing_only.status == "INFEASIBLE" and not checkpointing_only.variants


def test_a_batchnorm_with_a_weight_near_zero_keeps_its_input():
    bn, act, conv = torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1)
    for role, module in (("bn", bn), ("activation", act), ("conv", conv)):
        install_on(role, module)
    x = torch.randn(2, 4, 8, 8, requires_grad=True)

    def saved_storages() -> int:
        kept = set()
        with torch.autograd.graph.saved_tensors_hooks(
            lambda t: kept.add(t.untyped_storage().data_ptr()) or t, lambda t: t
        ):
            conv(act(bn(x * 1)))
        return len(kept - {p.untyped_storage().data_ptr() for p in (*bn.parameters(), *conv.parameters())})

    kept_by_variant = saved_storages()
    with torch.no_grad():
        bn.weight[0] = 0.0
    assert saved_storages() > kept_by_variant  # the unmodified BatchNorm, ReLU and conv keep more
    site = find_sites_for(bn)
    assert "weight below" in variant_ready(site[0], site[1])


def find_sites_for(bn: torch.nn.Module):
    from monet_cli.core.profile import VariantSite

    model = torch.nn.Sequential(bn, torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1))
    return model, VariantSite(impl="bn_output", ops=(1, 2, 3), modules=("0", "1", "2"))


def test_schedules_record_variants_and_refuse_one_inside_a_segment(chain_profile):
    every = frozenset(range(len(chain_profile.variants)))
    schedule = plan_schedule(chain_profile, {}, peaks=1, variants=every)
    assert all(isinstance(v, VariantDecision) for v in schedule.variants)
    assert variants_of(schedule, chain_profile) == every
    assert consistency_problem(schedule) is None
    # The predicted step includes the variants' measured time and the schedule's checks.
    assert schedule.predicted.step_ms == pytest.approx(
        chain_profile.baseline.step_ms
        + sum(v.time_ms for v in chain_profile.variants)
        + chain_profile.overheads.checks_ms,
        abs=1e-3,
    )
    from monet_cli.core.schedule import SegmentDecision

    inside = SegmentDecision(module="0", call=1, first_op=0, end_op=len(chain_profile.ops), recompute_ms=0.0)
    broken = with_content_hash(dataclasses.replace(schedule, decisions=(inside, *schedule.decisions)))
    assert "runs inside segment" in consistency_problem(broken)


def test_the_schedule_s_checks_are_paid_by_every_schedule(chain_profile):
    """``checks_ms`` (the checks ``apply`` installs for every training forward) is added to every
    plan, the empty one too: in the simulator, in the solver's objective, and in the schedule,
    whose ``predicted.checks_ms`` states it so its parts add up."""
    checks = 3.0
    unchecked, costly = (
        dataclasses.replace(chain_profile, overheads=dataclasses.replace(chain_profile.overheads, checks_ms=ms))
        for ms in (0.0, checks)
    )
    model = SegmentModel(costly)
    every = frozenset(range(len(costly.variants)))
    one_segment = {min(model.segments): frozenset()}
    for plan, variants in (({}, every), (one_segment, frozenset()), ({}, frozenset())):
        priced = simulate(costly, plan, model=model, variants=variants)
        assert priced.checks_ms == checks
        assert priced.added_ms == pytest.approx(simulate(unchecked, plan, variants=variants).added_ms + checks)
    assert simulate(costly, {}, model=model).added_ms == checks
    unconstrained = Planner(model).solve(costly.baseline.peak_bytes, time_limit_s=20, workers=1, seed=0)
    assert unconstrained.plan == {} and unconstrained.objective_ms == checks

    budget = simulate(costly, {}, model=model, variants=every).peak_bytes
    outcome = Planner(model).solve(budget, time_limit_s=20, workers=1, seed=0)
    assert outcome.status == "OPTIMAL" and outcome.variants and outcome.result.checks_ms == checks
    assert outcome.objective_ms == pytest.approx(outcome.result.added_ms, abs=0.01)

    schedule = plan_schedule(costly, {}, peaks=1, variants=every)
    plain = plan_schedule(unchecked, {}, peaks=1, variants=every)
    assert schedule.predicted.checks_ms == checks and plain.predicted.checks_ms == 0.0
    assert schedule.predicted.step_ms == pytest.approx(plain.predicted.step_ms + checks, abs=1e-4)
    assert consistency_problem(schedule) is None
    unpriced = with_content_hash(
        dataclasses.replace(schedule, predicted=dataclasses.replace(schedule.predicted, checks_ms=0.0))
    )
    assert "the checks" in consistency_problem(unpriced)


def test_rewrite_keeps_storage_ids_and_adds_temporaries(chain_profile):
    rewritten = with_variants(chain_profile, range(len(chain_profile.variants)))
    assert [s.id for s in rewritten.storages] == list(range(len(rewritten.storages)))
    temporaries = rewritten.storages[len(chain_profile.storages) :]
    # Each BatchNorm rebuilds its input and each convolution its activation, once per step.
    assert len(temporaries) == 4 and all(t.kind == "temp" for t in temporaries)


def test_cli_solve_inspect_and_no_variants(chain_profile, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "chain.profile.yaml"
    save_profile(chain_profile, path)
    every = frozenset(range(len(chain_profile.variants)))
    budget = str(simulate(chain_profile, {}, variants=every).peak_bytes)
    runner = CliRunner()
    solved = runner.invoke(app, ["solve", str(path), "--budget", budget, "--workers", "1", "--json", "-o", "v.yaml"])
    assert solved.exit_code == 0, solved.output
    assert json.loads(solved.stdout)["variants"] >= 1
    shown = runner.invoke(app, ["inspect", "v.yaml", "--profile", str(path), "--json"])
    report = json.loads(shown.stdout)
    assert report["variants"] and all(v["saves_bytes"] > 0 for v in report["variants"])
    assert report["tolerance"] == [1e-3, 1e-4]
    checked = runner.invoke(app, ["validate", "v.yaml", "--json"])
    assert checked.exit_code == 0, checked.output
    assert {"name": "variant modules", "status": "passed"}.items() <= next(
        c for c in json.loads(checked.stdout)["checks"] if c["name"] == "variant modules"
    ).items()
    plain = runner.invoke(
        app, ["solve", str(path), "--budget", budget, "--no-variants", "--workers", "1", "-o", "plain.yaml"]
    )
    assert plain.exit_code == 3 and "below the smallest peak" in plain.stderr, plain.output
    loose = runner.invoke(app, ["solve", str(path), "--budget", "100%", "--no-variants", "--json", "-o", "loose.yaml"])
    assert json.loads(loose.stdout)["variants"] == 0 and json.loads(loose.stdout)["tolerance"] is None


@pytest.fixture(scope="module")
def pool_profile():
    return profile_model(small_spec("tests.models_for_tests:pool_net", shape=(3, 32, 32), batch_size=4), CPU, steps=1)


def test_a_max_pooling_keeps_one_byte_offsets_and_stays_bit_exact(pool_profile):
    (site,) = pool_profile.variants  # the BatchNorm's ReLU feeds the pooling: no bn_output site
    assert (site.impl, site.modules) == ("maxpool_offsets", ("3",))
    pooled = 4 * 8 * 16 * 16
    assert site.saved_bytes == pooled  # uint8 offsets, where PyTorch keeps the input and int64 indices
    assert site.native_saved_bytes == pooled * 8 + 4 * pooled * 4
    schedule = plan_schedule(pool_profile, {}, peaks=1, variants=frozenset({0}))
    assert schedule.tolerance() is None and schedule.variants[0].rtol == 0.0
    report = run_apply(schedule, CPU, steps=1, check=True)
    assert report.measured_peak_bytes == schedule.predicted.peak_bytes
    assert report.check.mode == "exact" and report.check.ok and report.check.max_grad_diff == 0.0
    # Through the rest of the forward the step holds one byte per pooled value, not eight
    # (the input stays: the ReLU keeps it). This small model peaks in its optimizer step.
    last = len(pool_profile.ops) - 1
    before = dict(simulate(pool_profile, {}, timeline=True).timeline)[last]
    after = dict(simulate(pool_profile, {}, variants=frozenset({0}), timeline=True).timeline)[last]
    assert before - after == pooled * 8 - pooled


def test_subclasses_that_do_more_in_their_forward_are_not_offered():
    """A subclass's forward may do more than the variant replaces: timm's BatchNormAct2d applies
    its activation, a 'same'-padded convolution pads; neither may run a variant."""
    from monet_cli.core.profile import VariantSite

    class BatchNormAct(torch.nn.BatchNorm2d):
        def forward(self, x):
            return torch.relu(super().forward(x))

    site = VariantSite(impl="bn_output", ops=(1, 2, 3), modules=("0", "1", "2"))
    for model in (
        torch.nn.Sequential(BatchNormAct(4), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 1)),
        torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.ReLU(), torch.nn.Conv2d(4, 4, 3, padding="same")),
    ):
        assert "is not" in variant_ready(model, site)
    plain = torch.nn.Sequential(torch.nn.BatchNorm2d(4), torch.nn.ReLU6(), torch.nn.Conv2d(4, 4, 3, padding=1))
    assert variant_ready(plain, site) == ""


def test_a_profile_without_the_schedules_variants_is_a_usage_error(chain_profile):
    from monet_cli.errors import UsageError

    every = frozenset(range(len(chain_profile.variants)))
    schedule = plan_schedule(chain_profile, {}, peaks=1, variants=every)
    older = dataclasses.replace(chain_profile, variants=())
    with pytest.raises(UsageError, match="offers no operator variant or offload at '1'"):
        variants_of(schedule, older)
