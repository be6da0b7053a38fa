"""Offload: which calls a CUDA profile offers, the solver's rows for them, and the runtime's
hooks, run on this CPU through a host store of numpy arrays (``host_arrays.py``). Streams and
copy times need a GPU: ``tests/test_gpu.py``; under DDP: ``tests/test_distributed.py``."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from host_arrays import ArrayHost
from typer.testing import CliRunner

import monet_cli.core.offload as core_offload
import monet_cli.runtime.offload as runtime_offload
from monet_cli.cli.app import app
from monet_cli.core.codec import to_data
from monet_cli.core.plan import variants_of
from monet_cli.core.profile import Transfer, load_profile, save_profile
from monet_cli.core.schedule import (
    SegmentDecision,
    load_schedule,
    save_schedule,
    schedule_from_data,
    with_content_hash,
)
from monet_cli.core.segments import SegmentModel
from monet_cli.core.simulate import simulate
from monet_cli.core.solver.linear import LinearMemory, live_series
from monet_cli.core.solver.search import Planner
from monet_cli.errors import EXIT_DEVICE, DeviceError, FileFormatError, FingerprintError
from monet_cli.runtime.compare import run_apply
from monet_cli.runtime.executor import apply_schedule
from monet_cli.runtime.meter import MachineryMarker
from monet_cli.workload.step import build_workload
from tests.schedules_for_tests import plan_schedule

CPU = torch.device("cpu")
# About PCIe 4 with pinned memory: 25 GB/s each way, 10 us per copy.
TRANSFER = Transfer(fixed_ms=0.01, to_host_bytes_per_ms=25e6, to_device_bytes_per_ms=25e6)


@pytest.fixture
def host(monkeypatch):
    store = ArrayHost()
    monkeypatch.setattr(runtime_offload, "pinned_host_store", lambda: lambda device: store)
    return store


@pytest.fixture
def small_sites(monkeypatch):
    """resnet18 at 32 px moves well under 1 MiB per call: offer every call that moves anything."""
    monkeypatch.setattr(core_offload, "MIN_OFFLOAD_BYTES", 1)


def _offloads(model: SegmentModel) -> dict[str, int]:
    return {site.module: i for i, site in enumerate(model.profile.variants) if site.impl == "offload"}


def test_a_cpu_profile_offers_no_offload(resnet18_profile, small_sites):
    assert resnet18_profile.transfer is None
    assert not _offloads(SegmentModel(resnet18_profile))


def test_offload_rows_are_the_simulators_and_exclude_what_shares_their_tensors(resnet18_profile, small_sites):
    profile = replace(resnet18_profile, transfer=TRANSFER)
    model = SegmentModel(profile)
    offloads = _offloads(model)
    assert {"layer1", "layer1.0", "layer4.1"} <= set(offloads)
    linear = LinearMemory(model, variants=tuple(offloads.values()))
    base = simulate(profile, {}, model=model).peak_bytes
    lowered = 0
    for index in offloads.values():
        chosen = frozenset({index})
        mask = linear.active_mask({})
        assert np.array_equal(linear.live({}, chosen)[mask], linear.predict({}, chosen)[mask])
        result = simulate(profile, {}, model=model, variants=chosen)
        assert result.step_ms == pytest.approx(
            profile.baseline.step_ms + model.profile.variants[index].time_ms + profile.overheads.checks_ms
        )
        lowered += result.peak_bytes < base
    assert lowered
    # A call and its sub-call move the same tensors; a segment inside or around an offloaded
    # call would take its saves.
    assert tuple(sorted((offloads["layer1"], offloads["layer1.0"]))) in model.variant_clashes
    segment = {model.calls[c].fqn: c for c in model.segments}
    assert segment["layer1.0.conv1"] in model.variant_conflicts[offloads["layer1"]]
    assert segment["layer1"] in model.variant_conflicts[offloads["layer1.0"]]
    with pytest.raises(ValueError, match="change the same tensors"):
        simulate(profile, {}, model=model, variants=frozenset({offloads["layer1"], offloads["layer1.0"]}))


def test_the_solver_offloads_when_copies_are_cheaper_than_recompute(skip_cnn_profile, small_sites):
    free = replace(
        skip_cnn_profile,
        transfer=replace(TRANSFER, fixed_ms=0.0, to_host_bytes_per_ms=1e12, to_device_bytes_per_ms=1e12),
    )
    floor = Planner(SegmentModel(skip_cnn_profile)).minimum_peak(time_limit_s=20, workers=1, seed=0).peak_bytes
    budget = (skip_cnn_profile.baseline.peak_bytes + floor) // 2
    planner = Planner(SegmentModel(free))
    outcome = planner.solve(budget, time_limit_s=20, workers=1, seed=0)
    sites = planner.model.profile.variants
    assert outcome.result.peak_bytes <= budget and outcome.status == "OPTIMAL"
    assert outcome.plan == {} and outcome.variants and all(sites[v].impl == "offload" for v in outcome.variants)
    without = Planner(SegmentModel(free), offloads=False).solve(budget, time_limit_s=20, workers=1, seed=0)
    assert without.plan and not any(sites[v].impl == "offload" for v in without.variants)
    assert outcome.result.step_ms < without.result.step_ms


def _schedule(profile, model: SegmentModel, names: list[str], tmp_path):
    offloads = _offloads(model)
    schedule = plan_schedule(profile, {}, peaks=1, model=model, variants=frozenset(offloads[name] for name in names))
    save_schedule(schedule, tmp_path / "offload.yaml")
    loaded = load_schedule(tmp_path / "offload.yaml")  # the decision survives the file
    assert loaded == schedule and [o.module for o in loaded.offloads] == names
    assert variants_of(loaded, profile) == frozenset(offloads[name] for name in names)
    return loaded


def test_offloaded_calls_run_as_simulated_with_the_unmodified_gradients(resnet18_profile, small_sites, host, tmp_path):
    profile = replace(resnet18_profile, transfer=TRANSFER)
    model = SegmentModel(profile)
    names = ["bn1", "layer1", "layer3.1"]
    schedule = _schedule(profile, model, names, tmp_path)
    plan_variants = variants_of(schedule, profile)
    report = run_apply(schedule, CPU, steps=1, check=False, timeline=True)
    assert report.timeline == live_series(model, {}, plan_variants)
    assert report.measured_peak_bytes == schedule.predicted.peak_bytes < profile.baseline.peak_bytes
    per_step = sum(o.bytes for o in schedule.offloads)  # each storage copied once, however often saved
    assert host.copied_out and host.copied_out % per_step == 0
    checked = run_apply(schedule, CPU, steps=2, check=True)
    assert checked.check.grads_match and checked.check.params_match and checked.check.buffers_match


def test_a_changed_call_or_a_cpu_device_is_refused(resnet18_profile, small_sites, tmp_path):
    profile = replace(resnet18_profile, transfer=TRANSFER)
    schedule = _schedule(profile, SegmentModel(profile), ["layer1.0"], tmp_path)
    workload = build_workload(schedule.model, CPU)
    apply_schedule(workload.model, schedule)
    with pytest.raises(DeviceError, match="needs a CUDA device"):
        workload.step()  # no host store on a CPU
    offload = schedule.offloads[0]
    changed = replace(schedule, decisions=(replace(offload, saves=offload.saves + 1),))
    workload = build_workload(schedule.model, CPU)
    runtime_offload.install_offloads(
        [workload.model.get_submodule("layer1.0")],
        changed.offloads,
        MachineryMarker(),
        store=lambda device: ArrayHost(),
    )
    with pytest.raises(FingerprintError, match="saved .* tensors for backward"):
        workload.step()


def test_cli_solve_inspect_validate_and_a_refused_apply(skip_cnn_profile, small_sites, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "cnn.profile.yaml"
    free = replace(TRANSFER, fixed_ms=0.0, to_host_bytes_per_ms=1e12, to_device_bytes_per_ms=1e12)
    save_profile(replace(skip_cnn_profile, transfer=free), path)
    assert load_profile(path).transfer == free
    floor = Planner(SegmentModel(skip_cnn_profile)).minimum_peak(time_limit_s=20, workers=1, seed=0).peak_bytes
    budget = str((skip_cnn_profile.baseline.peak_bytes + floor) // 2)
    runner = CliRunner()
    solved = runner.invoke(app, ["solve", str(path), "--budget", budget, "--workers", "1", "--json", "-o", "s.yaml"])
    assert solved.exit_code == 0, solved.output
    summary = json.loads(solved.stdout)
    assert summary["offloads"] >= 1 and summary["offloaded_bytes"] > 0
    plain = runner.invoke(
        app, ["solve", str(path), "--budget", budget, "--workers", "1", "--json", "--no-offload", "-o", "plain.yaml"]
    )
    assert json.loads(plain.stdout)["offloads"] == 0
    schedule = json.loads(runner.invoke(app, ["inspect", "s.yaml", "--json"]).stdout)
    assert [o["module"] for o in schedule["offloads"]] == [
        o.module for o in load_schedule(tmp_path / "s.yaml").offloads
    ]
    offered = json.loads(runner.invoke(app, ["inspect", str(path), "--json"]).stdout)["offload_sites"]
    assert {o["module"] for o in schedule["offloads"]} <= {o["module"] for o in offered}
    checked = runner.invoke(app, ["validate", "s.yaml", "--json"])
    assert checked.exit_code == 0, checked.output
    assert "offload modules" in [c["name"] for c in json.loads(checked.stdout)["checks"]]
    applied = runner.invoke(app, ["apply", "s.yaml"])  # on this CPU: no host memory to move to
    assert applied.exit_code == EXIT_DEVICE and "offload needs a CUDA device" in applied.output
    assert "Traceback" not in applied.output


def test_an_offload_inside_a_segment_is_refused_on_load(resnet18_profile, small_sites, tmp_path):
    profile = replace(resnet18_profile, transfer=TRANSFER)
    schedule = _schedule(profile, SegmentModel(profile), ["layer1.0"], tmp_path)
    offload = schedule.offloads[0]
    layer1 = next(c for c in profile.calls if c.fqn == "layer1")
    segment = SegmentDecision(
        module="layer1", call=layer1.index, first_op=layer1.first_op, end_op=layer1.end_op, recompute_ms=0.0
    )
    edited = with_content_hash(replace(schedule, decisions=(segment, offload)))
    with pytest.raises(FileFormatError, match="offload at 'layer1.0' runs inside segment 'layer1'"):
        schedule_from_data(to_data(edited), source="edited.yaml")


def test_copies_come_back_one_ahead_of_need_and_cost_only_the_waits(resnet18_profile, small_sites):
    profile = replace(resnet18_profile, transfer=TRANSFER)
    layer1 = next(c for c in profile.calls if c.fqn == "layer1")
    plan = core_offload.plan_offload(profile, layer1)
    assert list(plan.needed) == sorted(plan.needed) and plan.returns[0] <= plan.needed[0]
    assert plan.returns[1:] == plan.needed[:-1]
    sizes = [profile.storages[sid].bytes for sid in plan.storages]
    hooks_ms = len(plan.packs) * profile.overheads.saved_tensor_ms

    def cost(transfer: Transfer) -> float:
        return core_offload._cost_ms(replace(profile, transfer=transfer), plan)

    free = Transfer(fixed_ms=0.0, to_host_bytes_per_ms=1e15, to_device_bytes_per_ms=1e15)
    assert cost(free) == pytest.approx(hooks_ms, abs=1e-9)  # hooks_ms is 0 where the chain priced no saved tensor
    slow_back = replace(free, to_device_bytes_per_ms=1e3)  # 1 MB/s: backward waits for nearly every copy
    copies_back_ms = sum(sizes) / 1e3
    backward_ms = sum(op.time_ms for op in profile.backward)
    assert copies_back_ms - backward_ms <= cost(slow_back) - hooks_ms <= copies_back_ms


def test_a_host_tensor_the_call_saves_is_not_moved(resnet18_profile, small_sites):
    """A CUDA step saves attention's dropout seed and offset as host tensors, which its profile
    counts as 0 bytes: an offload leaves them where they are (moving one stopped the step)."""
    profile = replace(resnet18_profile, transfer=TRANSFER)
    call = next(c for c in profile.calls if c.fqn == "layer1.0")
    moved = core_offload.plan_offload(profile, call).storages
    storages = list(profile.storages)
    storages[moved[0]] = replace(storages[moved[0]], bytes=0)  # as if it lived on the host
    offload = core_offload.plan_offload(replace(profile, storages=type(profile.storages)(storages)), call)
    assert offload is not None and list(offload.storages) == list(moved[1:])
