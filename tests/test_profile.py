"""The profile measures what a step really costs, and its file round-trips exactly."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import small_spec

from monet_cli.core.profile import dump_profile, load_profile, profile_from_data, save_profile
from monet_cli.core.yamlio import load_yaml_file
from monet_cli.profiler.capture import StepRecorder
from monet_cli.profiler.run import profile_model
from monet_cli.runtime.meter import LiveStorageMeter, measure_step
from monet_cli.workload.step import build_workload
from tests.schedules_for_tests import plan_schedule

CPU = torch.device("cpu")


def _warm_workload(spec):
    workload = build_workload(spec, CPU)
    workload.zero_grad()
    workload.step()
    workload.zero_grad()
    return workload


def test_profile_file_round_trips(resnet18_profile, tmp_path):
    path = tmp_path / "r18.profile.yaml"
    save_profile(resnet18_profile, path)
    loaded = load_profile(path)
    assert loaded == resnet18_profile
    assert dump_profile(loaded) == path.read_text()


def test_the_allocator_settings_are_kept_where_set(resnet18_profile, tmp_path):
    """A CUDA profile keeps the allocator settings it was made under; a CPU profile says nothing."""
    assert "alloc_conf" not in dump_profile(resnet18_profile)
    device = dataclasses.replace(resnet18_profile.device, type="cuda", alloc_conf="expandable_segments:True")
    path = tmp_path / "cuda.profile.yaml"
    save_profile(dataclasses.replace(resnet18_profile, device=device), path)
    assert "alloc_conf: expandable_segments:True" in path.read_text()
    assert load_profile(path).device == device


def test_profile_keys_and_types(resnet18_profile, tmp_path):
    path = tmp_path / "p.yaml"
    save_profile(resnet18_profile, path)
    data = load_yaml_file(path)
    assert list(data)[:10] == [
        "schema_version",
        "kind",
        "model",
        "device",
        "env",
        "fingerprint",
        "baseline",
        "memory",
        "overheads",
        "created_at",
    ]
    assert data["schema_version"] == 1 and data["kind"] == "monet.profile"
    assert isinstance(data["baseline"]["peak_bytes"], int)
    assert isinstance(data["baseline"]["step_ms"], float)
    assert set(data["env"]) == {"monet", "torch", "torchvision", "ortools", "python"}
    op = data["ops"][0]
    assert op["op"] == "aten.convolution.default" and op["module"] == "conv1"
    assert isinstance(op["out_bytes"], int) and isinstance(op["time_ms"], float)


def test_baseline_peak_equals_meter_on_same_step(resnet18_profile):
    workload = _warm_workload(small_spec())
    pre = workload.resident_tensors()
    measured = measure_step(workload.step, device=CPU, preexisting=pre)
    assert measured.meter == "live-storages"
    assert measured.peak_bytes == resnet18_profile.baseline.peak_bytes


def test_recorder_sees_the_same_peak_as_the_plain_meter():
    workload = _warm_workload(small_spec("tests.models_for_tests:skip_cnn"))
    pre = workload.resident_tensors()
    plain = measure_step(workload.step, device=CPU, preexisting=pre).peak_bytes
    recorder = StepRecorder(workload)
    recorder.record_step()
    assert recorder.peak_bytes == plain


def test_a_profiled_model_is_freed_once_its_profile_is_made(monkeypatch):
    """On CUDA the allocator counts every live tensor of the process: a model kept alive after
    its profile would count in every later measurement (it did: the recorder's storage
    finalizers held it)."""
    import weakref

    import monet_cli.profiler.run as run

    models = []

    def build_and_watch(*args, **kwargs):
        workload = build_workload(*args, **kwargs)
        models.append(weakref.ref(workload.model))
        return workload

    monkeypatch.setattr(run, "build_workload", build_and_watch)
    profile_model(small_spec("tests.models_for_tests:skip_cnn"), CPU, steps=1)
    assert models and all(model() is None for model in models)


def test_meter_is_deterministic():
    workload = _warm_workload(small_spec())
    peaks = set()
    for _ in range(2):
        workload.zero_grad()
        pre = workload.resident_tensors()
        peaks.add(measure_step(workload.step, device=CPU, preexisting=pre).peak_bytes)
    assert len(peaks) == 1


def _live_activations_after_forward(spec) -> int:
    workload = _warm_workload(spec)
    meter = LiveStorageMeter()
    meter.register(t for t, _ in workload.resident_tensors())
    before = meter.current_bytes
    with meter:
        loss = workload.forward_loss()
    return meter.current_bytes - before - loss.untyped_storage().nbytes()


def test_saved_bytes_add_up_to_live_activations(resnet18_profile, skip_cnn_profile):
    for profile, spec in [
        (resnet18_profile, small_spec()),
        (skip_cnn_profile, small_spec("tests.models_for_tests:skip_cnn")),
    ]:
        live = _live_activations_after_forward(spec)
        assert sum(op.saved_bytes for op in profile.ops) == live
        assert profile.memory.saved_activation_bytes == live


def test_fingerprint_stable_and_batch_sensitive(resnet18_profile):
    again = profile_model(small_spec(), CPU, steps=1)
    assert again.fingerprint == resnet18_profile.fingerprint
    bigger = profile_model(small_spec(batch_size=3), CPU, steps=1)
    assert bigger.fingerprint.shapes != resnet18_profile.fingerprint.shapes
    assert bigger.fingerprint.structure == resnet18_profile.fingerprint.structure


def test_ops_consumers_and_inplace_groups(skip_cnn_profile):
    ops = skip_cnn_profile.ops
    for op in ops:
        for consumer in op.consumers:
            assert consumer > op.index and op.index in ops[consumer].inputs
    # BatchNorm's num_batches_tracked += 1 writes a buffer, not an activation: no group.
    assert all(op.inplace_of is None for op in ops if op.op == "aten.add_.Tensor")
    cat = next(op for op in ops if op.op == "aten.cat.default")
    assert len(cat.inputs) == 2  # both branches of the concatenation skip


def test_segments_are_module_calls(skip_cnn_profile):
    calls = {c.fqn: c for c in skip_cnn_profile.calls}
    assert calls["stem"].checkpointable and calls["body"].checkpointable
    assert not calls[""].checkpointable  # the model itself is never a segment
    for call in skip_cnn_profile.calls:
        assert call.first_op <= call.end_op
        assert all(skip_cnn_profile.ops[i].module.startswith(call.fqn) for i in range(call.first_op, call.end_op))


def test_out_of_place_activations_are_recorded(skip_cnn_profile):
    names = [op.op for op in skip_cnn_profile.ops]
    assert "aten.relu.default" in names and "aten.relu_.default" not in names


def test_backward_events(resnet18_profile):
    p = resnet18_profile
    assert p.backward[0].pos == len(p.ops)
    assert {b.phase for b in p.backward} == {"backward", "optimizer"}
    grads = [s for s in p.storages if s.kind == "grad"]
    assert sum(s.bytes for s in grads) == p.memory.grad_bytes == p.memory.param_bytes
    assert all(s.alloc >= len(p.ops) and s.free is None for s in grads)
    activation_packs = [pk for pk in p.packs if p.storages[pk.storage].kind == "activation"]
    assert activation_packs and all(pk.release is not None and pk.release >= len(p.ops) for pk in activation_packs)


def test_loader_rejects_changed_types(resnet18_profile):
    import pytest

    from monet_cli.core.codec import to_data
    from monet_cli.errors import FileFormatError

    data = to_data(resnet18_profile)
    data["baseline"] = dict(data["baseline"], peak_bytes="lots")
    with pytest.raises(FileFormatError, match=r"x.yaml: baseline.peak_bytes: expected int"):
        profile_from_data(data, source="x.yaml")
    data = to_data(dataclasses.replace(resnet18_profile))
    del data["fingerprint"]
    with pytest.raises(FileFormatError, match=r"x.yaml: fingerprint: missing key"):
        profile_from_data(data, source="x.yaml")


def test_a_recompute_runs_the_forward_code_around_each_op_again(resnet18_profile):
    """A recompute pays the measured code cost for every op it re-runs, kept ones too (their
    code runs, their kernels do not). Here without the calls' wall times, as in profiles
    made before they were measured."""
    from dataclasses import replace

    from monet_cli.core.segments import SegmentModel

    costs = replace(resnet18_profile.overheads, python_op_ms=0.02)
    calls = tuple(replace(call, time_ms=None) for call in resnet18_profile.calls)
    model = SegmentModel(replace(resnet18_profile, overheads=costs, calls=calls))
    ops = resnet18_profile.ops
    for call, seg in model.segments.items():
        if seg.burst_pos is None:
            continue
        rerun = range(seg.first_op, seg.stop)
        assert model.recompute_ms(call) == pytest.approx(sum(ops[i].time_ms for i in rerun) + 0.02 * len(rerun))
        for kept in seg.candidates[:1]:
            saved = model.recompute_ms(call) - model.recompute_ms(call, frozenset({kept}))
            assert saved == pytest.approx(ops[kept].time_ms)


def test_module_calls_are_timed_in_the_plain_step_that_gives_the_step_time(resnet18_profile):
    """Every call's forward has a wall time; a call's time holds its sub-calls' (nested spans
    of one clock in each timed step, and so in the profile, which takes medians of the time
    outside sub-calls), and the model's forward lies inside the step."""
    calls = resnet18_profile.calls
    assert all(call.time_ms is not None and call.time_ms > 0 for call in calls)
    for call in calls:
        inside = sum(c.time_ms for c in calls if c.parent == call.index)
        assert call.time_ms >= inside - 1e-3 * (1 + len(calls)), call.fqn  # rounded to 1e-4 ms each
    assert calls[0].parent is None and calls[0].time_ms <= resnet18_profile.baseline.step_ms


def test_call_times_nest_when_their_medians_one_by_one_would_not():
    """Three steps of a call with two sub-calls whose times swap between steps: the medians
    taken one by one give the sub-calls 7 ms inside a 4 ms call. The profile takes the median
    of the time outside sub-calls (0.4 ms) and adds the sub-calls' medians."""
    from monet_cli.profiler.capture import Timings

    timings = Timings(call_ms=[[4.0, 3.5, 0.1], [10.0, 5.0, 4.5], [4.0, 0.1, 3.5]])
    assert timings.median_call_ms([None, 0, 0]) == pytest.approx([7.4, 3.5, 3.5])


def test_a_profile_warns_when_the_machine_speed_changed_while_it_ran():
    """The plain step is timed again at the end: as many steps as the profile timed, and a
    warning when their median is more than ``SPEED_CHANGE`` off the profile's step."""
    import warnings

    from monet_cli.core.profile import SPEED_CHANGE
    from monet_cli.profiler.run import warn_on_speed_change

    class Steps:
        def __init__(self, ms):
            self.ms, self.timed = ms, 0

        def timed_step(self):
            self.timed += 1
            return self.ms

    slower = Steps(50.0 * SPEED_CHANGE * 1.01)
    with pytest.warns(
        UserWarning, match="speed changed while profiling: the plain step took 50.0 ms when timed and 60.6"
    ):
        warn_on_speed_change(slower, [49.0, 50.0, 70.0])
    assert slower.timed == 3
    with pytest.warns(UserWarning, match="took 50.0 ms when timed and 41.3 ms"):
        warn_on_speed_change(Steps(50.0 / SPEED_CHANGE / 1.01), [50.0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_on_speed_change(Steps(50.0 * SPEED_CHANGE * 0.99), [50.0])
        warn_on_speed_change(Steps(50.0 / SPEED_CHANGE * 1.01), [50.0])
        warn_on_speed_change(Steps(0.5 * SPEED_CHANGE * 1.5), [0.5])  # a sub-millisecond step's jitter


def test_a_profile_warns_when_the_step_s_noise_may_move_a_prediction_by_3_points(shipped_pricing):
    """``price_noise_ms`` above 3% of the step (the time model's target) warns with both
    figures; at or below it, nothing."""
    import warnings

    from monet_cli.core.profile import Overheads
    from monet_cli.profiler.run import warn_if_noisy_prices

    with pytest.warns(UserWarning, match=r"hold to \+-4\.5 ms at 90% \(4\.5% of the step\)"):
        warn_if_noisy_prices(Overheads(price_noise_ms=4.5), 100.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warn_if_noisy_prices(Overheads(price_noise_ms=3.0), 100.0)
        warn_if_noisy_prices(Overheads(), 100.0)


@contextlib.contextmanager
def _another_process_spinning(on_cpu: int | None = None):
    pin = None if on_cpu is None else lambda: os.sched_setaffinity(0, {on_cpu})
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=pin)
    try:
        time.sleep(0.3)  # its interpreter starts
        yield
    finally:
        spinner.kill()
        spinner.wait()


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux /proc/stat")
def test_other_work_is_the_cpu_time_all_processes_used_less_monet_s_own(monkeypatch):
    """The CPU time every process used between two readings, less this process's own, is
    other work: a process spinning beside it is counted (about one CPU) and its own work is
    not. The warning fires when other work took more than ``SPARE_CPUS`` beyond the CPUs
    torch's threads leave free, and says nothing where ``/proc/stat`` cannot be read."""
    import warnings

    from monet_cli.runtime import sharing

    def others_while_working(seconds: float) -> float:
        start = sharing.read_cpu_times()
        end_at = time.monotonic() + seconds
        while time.monotonic() < end_at:  # this process's own work
            pass
        return sharing.others_busy_cpus(start, sharing.read_cpu_times())

    with _another_process_spinning():
        assert 0.7 < others_while_working(0.6) < 1.6  # one CPU, and not this process's own on top
    assert others_while_working(0.6) < 0.5  # alone: its own work is not counted

    monkeypatch.setattr(sharing, "usable_cpus", lambda: {0, 1})
    monkeypatch.setattr(sharing.torch, "get_num_threads", lambda: 2)
    with pytest.warns(UserWarning, match="other work kept 0.6 of the 2 CPUs monet may run on busy while it ran .*; so"):
        sharing.warn_if_shared(0.6, "it ran", "so")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        sharing.warn_if_shared(0.4, "it ran", "so")
        sharing.warn_if_shared(None, "it ran", "so")  # not read
        monkeypatch.setattr(sharing.torch, "get_num_threads", lambda: 1)  # one CPU left free
        sharing.warn_if_shared(1.4, "it ran", "so")

    start = sharing.CpuTimes(wall_s=0.0, busy_s=0.0, own_s=0.0)
    short = sharing.CpuTimes(wall_s=10.0 - sharing.MIN_WINDOW_S / 2, busy_s=0.0, own_s=0.0)
    monkeypatch.setattr(sharing, "read_cpu_times", lambda: sharing.CpuTimes(wall_s=10.0, busy_s=26.0, own_s=20.0))
    assert sharing.others_busy_since(start) == pytest.approx(0.6)
    assert sharing.others_busy_since(short) is None  # too short a window to judge
    assert sharing.others_busy_since(None) is None


@pytest.mark.skipif(
    not Path("/proc/stat").exists() or len(os.sched_getaffinity(0)) < 2, reason="reads Linux /proc/stat, on 2 CPUs"
)
def test_other_work_counts_only_on_the_cpus_this_process_may_run_on(monkeypatch):
    """A container's cpuset leaves the process some of the machine's CPUs: a process spinning
    on another CPU takes nothing from it, one spinning on its own CPU does."""
    from monet_cli.runtime import sharing

    mine, other = sorted(os.sched_getaffinity(0))[:2]
    monkeypatch.setattr(sharing, "usable_cpus", lambda: {mine})

    def others_while_sleeping() -> float:
        start = sharing.read_cpu_times()
        time.sleep(0.6)
        return sharing.others_busy_cpus(start, sharing.read_cpu_times())

    with _another_process_spinning(on_cpu=other):
        assert others_while_sleeping() < 0.3
    with _another_process_spinning(on_cpu=mine):
        assert others_while_sleeping() > 0.7


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads Linux /proc/stat")
def test_profile_and_apply_warn_when_another_process_works_beside_their_timed_steps(monkeypatch, tmp_path):
    """A CPU profile, and ``apply``'s timed pairs, beside a process spinning on one CPU: both
    warn, since their times assume the machine to themselves (torch's threads are taken to use
    every CPU, so the spinner is more than any machine leaves free), and the profile records
    the other work beside the times it qualifies."""
    from typer.testing import CliRunner

    from monet_cli.cli.app import app
    from monet_cli.core.segments import SegmentModel
    from monet_cli.runtime import sharing
    from monet_cli.runtime.compare import run_apply

    monkeypatch.setattr(sharing.torch, "get_num_threads", lambda: len(sharing.usable_cpus()))
    # Three steps: with one, the spinner left the profile 0.96 to 1.21 s (12-06), and under
    # MIN_WINDOW_S nothing is judged (the fresh-clone CI saw no warning once).
    with _another_process_spinning(), pytest.warns(UserWarning, match="busy while the profile ran"):
        profile = profile_model(small_spec("tests.models_for_tests:skip_cnn"), CPU, steps=3)
    assert profile.baseline.other_work_cpus > sharing.SPARE_CPUS  # recorded with the times it qualifies
    save_profile(profile, tmp_path / "p.yaml")
    assert load_profile(tmp_path / "p.yaml").baseline.other_work_cpus == profile.baseline.other_work_cpus
    shown = CliRunner().invoke(app, ["inspect", str(tmp_path / "p.yaml")], env={"COLUMNS": "200"})
    assert f"other work kept {profile.baseline.other_work_cpus:.2f} CPUs busy meanwhile" in shown.stdout
    model = SegmentModel(profile)
    call = next(c for c, seg in model.segments.items() if seg.burst_pos is not None)
    schedule = plan_schedule(profile, {call: frozenset()}, peaks=1, model=model)
    pairs = 3 + int(1.5 * sharing.MIN_WINDOW_S * 1000 / (2 * profile.baseline.step_ms))  # long enough to judge
    with _another_process_spinning(), pytest.warns(UserWarning, match="busy while apply timed its steps"):
        run_apply(schedule, CPU, steps=pairs, check=False)


def test_a_model_whose_module_calls_change_between_steps_is_refused():
    """The calls' wall times are matched to the recorded calls by order: a model making other
    calls in a later step (same ops) is refused in one line rather than priced from the
    wrong calls."""
    from monet_cli.errors import ModelError

    spec = small_spec("tests.models_for_tests:changing_calls_net", shape=(16,))
    with pytest.raises(ModelError, match="different module calls in two steps"):
        profile_model(spec, torch.device("cpu"), steps=1)


def test_a_recompute_costs_the_wall_time_of_the_code_it_re_runs(resnet18_profile):
    """A whole call's recompute costs its forward's wall time. A stretch of a call (an op range,
    a chain) runs that call's calls as calls: an op inside one costs its timed time scaled as
    that call's wall over its ops' timed sum, an own op scaled as the parent's. A kept op
    saves its share."""
    from dataclasses import replace

    from monet_cli.core.segments import SegmentModel

    model = SegmentModel(replace(resnet18_profile, overheads=replace(resnet18_profile.overheads, python_op_ms=0.0)))
    ops, calls = resnet18_profile.ops, resnet18_profile.calls

    def scale(call):
        return calls[call].time_ms / sum(op.time_ms for op in ops[calls[call].first_op : calls[call].end_op])

    def scale_in(parent, op):
        inside = [c.index for c in calls if c.parent == parent and c.first_op <= op < c.end_op]
        return scale(inside[0] if inside else parent)

    checked = {"whole": 0, "stretch": 0, "whole stopped early": 0}
    for call, seg in model.segments.items():
        if seg.burst_pos is None:
            continue
        if call in model.members or call in model.ranges:
            parent = model.calls[call].parent
            op_scale = {i: scale_in(parent, i) for i in range(seg.first_op, seg.stop)}
            checked["stretch"] += 1
        else:
            op_scale = {i: scale(call) for i in range(seg.first_op, seg.stop)}
            if seg.stop == seg.end_op:
                assert model.recompute_ms(call) == pytest.approx(calls[call].time_ms, rel=1e-3), seg.fqn
            checked["whole" if seg.stop == seg.end_op else "whole stopped early"] += 1
        assert model.recompute_ms(call) == pytest.approx(sum(s * ops[i].time_ms for i, s in op_scale.items())), seg.fqn
        for kept in seg.candidates[:1]:
            saved = model.recompute_ms(call) - model.recompute_ms(call, frozenset({kept}))
            assert saved == pytest.approx(min(1.0, op_scale[kept]) * ops[kept].time_ms)
    assert checked["whole"] >= 8 and checked["stretch"] >= 8, checked
    stretches = [c for c in model.segments if c in model.ranges and model.segments[c].burst_pos is not None]
    assert any(
        len(
            {
                round(scale_in(model.calls[c].parent, i), 9)
                for i in range(model.segments[c].first_op, model.segments[c].stop)
            }
        )
        > 1
        for c in stretches
    ), "no range runs code at two scales: the test would not tell the rules apart"


def test_checkpoint_machinery_is_priced_per_saved_tensor(resnet18_profile):
    """Each tensor a frame saves costs a pack, a second pack in the recompute and an unpack:
    the profile measures that apart from the fixed cost of a checkpointed call. An op range's
    own ops each cost the measured time of recording and replaying one (its recorder is off
    while its calls run: their ops cost nothing more)."""
    from dataclasses import replace

    from monet_cli.core.profile import Overheads
    from monet_cli.core.segments import SegmentModel

    measured = dataclasses.asdict(resnet18_profile.overheads)
    # Each price is a difference of medians, held at 0 where noise puts it below: whether one
    # comes out above 0 is the machine's business (a loaded CI runner priced the tape at 0).
    assert any(measured.values()) and all(v is None or 0 <= v < 10 for v in measured.values()), measured
    costs = Overheads(segment_ms=0.5, saved_tensor_ms=0.01, policy_op_ms=0.002, range_op_ms=0.03)
    model = SegmentModel(replace(resnet18_profile, overheads=costs))

    def recorder(call: int) -> float:
        seg = model.segments[call]
        return 0.03 * seg.range.own_ops if seg.range else 0.0

    assert any(seg.range for seg in model.segments.values())
    for call, seg in model.segments.items():
        assert model.overhead_ms(call) == pytest.approx(0.5 + 0.01 * len(seg.packs) + recorder(call))
        kept = frozenset(seg.candidates[:1])
        if kept:
            policy = 0.002 * 2 * (seg.end_op - seg.first_op)
            assert model.overhead_ms(call, kept) == pytest.approx(0.5 + 0.01 * len(seg.packs) + policy)
    outer, inner = model.nest_pairs[0]
    frame = model.frames({outer: frozenset(), inner: frozenset()})[outer]
    own = len(model.segments[outer].packs) - len(model.segments[inner].packs)
    assert frame.saves == own + len(resnet18_profile.calls[inner].inputs)
    assert model.overhead_ms(outer, frame=frame) == pytest.approx(0.5 + 0.01 * frame.saves + recorder(outer))


def _stub_checkpointed_forward(module, keep, marker, *, selective=False):
    """The executor's checkpointed forward for stubbed timings: it says whether it runs the
    keep policy, and runs nothing."""

    def forward(*_args, **_kwargs):
        raise AssertionError("the stubbed timings run no forward")

    forward.selective = selective
    return forward


def test_checkpoint_s_frame_and_policy_are_priced_in_the_step(resnet18_profile, monkeypatch, shipped_pricing):
    """The cheapest calls to checkpoint (none nested in another, no BatchNorm), the few
    cheapest of them and the largest run checkpointed in the real step against plain steps,
    interleaved round by round: what each set adds beyond its price is a cost paid once,
    frames and re-run ops, which the three sets weigh differently, so the once goes to
    ``first_frame_ms``, the frame's extra to ``segment_ms`` and each re-run op's to
    ``python_op_ms``. The largest calls run under a selective policy against plain checkpoint: the difference per op, forward and
    recompute, is ``policy_op_ms``. All in the profile's time. The step's timings are the
    benchmarks' business: here the step is a stub that reads which forwards are swapped and
    adds a known cost for each.

    Each set runs as a schedule runs it: the executor's checkpointed forward, its BatchNorms
    guarded while it runs and unguarded after. The schedule's checks on every training forward
    are registered on the root in every step of the rounds, the plain ones too, so their 0.2
    ms here stays out of the once (0.7), and off in the steps that time the calls' walls.

    The machine runs twice as slow as in the profile's steps, but its forwards only 1.5 times:
    each set's recomputes are priced at the calls' walls timed in plain steps between its
    pairs, not at the profile's."""
    from dataclasses import replace

    from monet_cli.core.segments import SegmentModel
    from monet_cli.profiler import alone, in_step
    from monet_cli.profiler.capture import Timings, retimed

    profile = replace(
        resnet18_profile,
        baseline=replace(resnet18_profile.baseline, step_ms=10.0, steps=3),
        overheads=replace(resnet18_profile.overheads, python_op_ms=0.0),
    )
    model = SegmentModel(profile)
    step_speed, forward_speed = 2.0, 1.5
    walls = [forward_speed * call.time_ms for call in profile.calls]
    now = SegmentModel(retimed(profile, Timings(step_ms=[step_speed * 10.0], call_ms=[walls])))
    walls_timed = [0]

    class CallTimer:
        def __init__(self, _workload) -> None:
            pass

        def step(self) -> tuple[float, list[float]]:
            assert not swapped(), "calls timed in a checkpointed step"
            assert not workload.model._forward_pre_hooks, "calls timed with the schedule's checks on"
            walls_timed[0] += 1
            return step_speed * 10.0, walls

    monkeypatch.setattr(in_step, "CallTimer", CallTimer)
    monkeypatch.setattr(alone, "checkpointed_forward", _stub_checkpointed_forward)
    index = {model.calls[c].fqn: c for c in model.segments}
    workload = build_workload(small_spec(), CPU)
    modules = dict(workload.model.named_modules())
    swapped_together: set[frozenset[str]] = set()
    guarded_when: set[tuple[frozenset[str], bool]] = set()
    policies: set[frozenset[str]] = set()
    steps_run = [0]

    def swapped() -> dict[str, object]:
        return {name: m.__dict__["forward"] for name, m in modules.items() if "forward" in m.__dict__}

    def step(*_args, **_kwargs) -> float:
        steps_run[0] += 1
        ms = 10.0  # the rest in the profile's time, as the machine runs now
        priced_now = 0.0
        for name, forward in swapped().items():
            seg = model.segments[index[name]]
            assert not isinstance(modules[name], torch.nn.BatchNorm2d), name
            priced_now += now.added_ms(index[name])
            ms += 0.5 + 0.004 * (seg.stop - seg.first_op)
            batchnorms = [m for m in modules[name].modules() if isinstance(m, torch.nn.BatchNorm2d)]
            assert all(getattr(m, "_monet_guarded", False) for m in batchnorms), "BatchNorms unguarded"
            if forward.selective:
                ms += 0.03 * 2 * (seg.end_op - seg.first_op)
                policies.add(frozenset(swapped()))
        ms += 0.7 if swapped() else 0.0
        guarded = bool(workload.model._forward_pre_hooks)
        ms += 0.2 if guarded else 0.0
        swapped_together.add(frozenset(swapped()))
        guarded_when.add((frozenset(swapped()), guarded))
        taken = sorted((model.segments[index[n]].first_op, model.segments[index[n]].end_op) for n in swapped())
        assert all(end <= start for (_, end), (start, _) in zip(taken, taken[1:])), "nested calls checkpointed at once"
        return step_speed * ms + priced_now

    monkeypatch.setattr(workload, "timed_step", step)
    priced = in_step.price_in_step(workload, profile, 3)
    assert priced.first_frame_ms == pytest.approx(0.7, abs=1e-5)
    assert priced.segment_ms == pytest.approx(profile.overheads.segment_ms + 0.5, abs=1e-5)
    assert priced.python_op_ms == pytest.approx(0.004, abs=1e-6)
    assert priced.policy_op_ms == pytest.approx(0.03, abs=1e-6)
    largest = next(iter(policies))
    cheapest = {s for s in swapped_together - {frozenset()} - policies if s != largest}
    assert sorted(len(s) for s in cheapest) == [in_step.FEW_FRAMES, in_step.FRAMES]
    assert {"layer1", "layer4", "fc"} <= largest
    assert all((s, True) in guarded_when and (s, False) not in guarded_when for s in cheapest)
    assert (largest, True) in guarded_when  # and unguarded: the policy pairs it with plain checkpoint
    assert (frozenset(), True) in guarded_when
    assert not swapped(), "forwards left swapped"
    assert not workload.model._forward_pre_hooks, "the schedule's checks left on the root"
    assert not any(getattr(m, "_monet_guarded", False) or m._forward_hooks for m in modules.values())
    # 3 timed steps: 30 pairs a measurement. The three sets take the steps of three measurements,
    # walls steps included, in rounds of four steps; the policy pairs on its own.
    policy_steps = 2 * (in_step.WARM_UP_PAIRS + 3 * in_step.PAIRS_PER_STEP)
    sets_steps = 3 * in_step._steps_to_pair(3 * in_step.PAIRS_PER_STEP)
    assert sets_steps - 5 < steps_run[0] - policy_steps + walls_timed[0] <= sets_steps
    rounds = (steps_run[0] - policy_steps) // 4 - in_step.WARM_UP_PAIRS
    assert steps_run[0] - policy_steps == 4 * (in_step.WARM_UP_PAIRS + rounds)
    assert walls_timed[0] == -(-rounds // in_step.WALLS_EVERY)
    assert rounds > 1.5 * 3 * in_step.PAIRS_PER_STEP  # one plain step serves three sets
    steps_run[0] = walls_timed[0] = 0
    assert in_step.price_in_step(workload, profile, 1) == priced  # `monet profile --steps 1` pairs fewer
    assert steps_run[0] <= 2 * (in_step.WARM_UP_PAIRS + in_step.PAIRS_PER_STEP) + 3 * in_step._steps_to_pair(
        in_step.PAIRS_PER_STEP
    )


def test_the_step_s_noise_is_measured_on_the_largest_calls_set(resnet18_profile, monkeypatch, shipped_pricing):
    """``price_noise_ms`` is half the 90% interval of the median difference the largest calls
    made, in the profile's time: the cheap sets' spread does not enter it, and a machine twice
    as slow as the profile's steps halves it. Where it passes ``NOISY_PRICES`` of the step the
    sets' rounds run once more, and every figure is taken over both; a quiet step runs them once."""
    from dataclasses import replace

    from monet_cli.core.stats import median_interval
    from monet_cli.profiler import in_step
    from monet_cli.profiler.capture import Timings

    profile = replace(resnet18_profile, baseline=replace(resnet18_profile.baseline, step_ms=10.0, steps=3))
    walls = [2.0 * call.time_ms for call in profile.calls]
    noisy = [30.0, 31.0, 26.0, 38.0, 29.0, 33.0, 35.0, 27.0, 30.5, 32.0, 24.0, 36.0, 31.5]
    batches: list[list[float]] = []

    def interleaved(_workload, switches, _pairs, timings: Timings, _checks) -> list[list[float]]:
        timings.step_ms.append(20.0)
        timings.call_ms.append(walls)
        cheap = [1.0, 100.0, -100.0] * 4  # widely spread: not the largest calls'
        return [cheap] * (len(switches) - 1) + [batches[len(timings.step_ms) - 1]]

    monkeypatch.setattr(in_step, "_interleaved", interleaved)
    monkeypatch.setattr(in_step, "_paired", lambda *_args: (20.0, 0.0))
    workload = build_workload(small_spec(), CPU)

    def half_width(values: list[float]) -> float:
        low, high = median_interval(values, in_step.CONFIDENCE)
        return (high - low) / 2

    assert half_width(noisy) == 2.0 > in_step.NOISY_PRICES * 20.0  # the 4th smallest (29) to the 4th largest (33)
    batches[:] = [noisy, [ms + 10.0 for ms in noisy]]
    priced = in_step.price_in_step(workload, profile, 3)
    assert priced.price_noise_ms == pytest.approx(half_width(batches[0] + batches[1]) / 2.0, abs=1e-6)
    assert half_width(batches[0] + batches[1]) != half_width(noisy)

    quiet = [30.0 + 0.05 * k for k in range(13)]
    batches[:] = [quiet, [ms + 10.0 for ms in noisy]]
    priced_quiet = in_step.price_in_step(workload, profile, 3)
    assert priced_quiet.price_noise_ms == pytest.approx(half_width(quiet) / 2.0, abs=1e-6)
    assert half_width(batches[0] + batches[1]) > 2 * half_width(quiet)  # so the second batch did not run


def test_the_schedule_s_checks_are_timed_on_their_own_hooks(monkeypatch):
    """``checks_ms`` is the time the schedule's checks take in a training forward: the hooks
    between the timing hooks registered around them, and not the model's own root hooks
    registered before (10 ms each way here). Switched off, the checks and the timing hooks are
    gone and the model's own hooks stay."""
    from monet_cli.profiler import in_step

    def busy(ms: float):
        def hook(*_args) -> None:
            end = time.perf_counter() + ms / 1000.0
            while time.perf_counter() < end:
                pass

        return hook

    def checks(model, *_args, **_kwargs):
        return [model.register_forward_pre_hook(busy(1.0)), model.register_forward_hook(busy(1.0))]

    monkeypatch.setattr(in_step, "install_guards", checks)
    monkeypatch.setattr(in_step, "install_output_check", lambda *_args: [])
    model = torch.nn.Linear(4, 4)
    model.register_forward_pre_hook(busy(10.0))
    model.register_forward_hook(busy(10.0))
    timed = in_step._TimedChecks(model, profile=SimpleNamespace(fingerprint=None, model=None))
    timed.set(True)
    for _ in range(5):
        model(torch.ones(2, 4))
    timed.set(False)
    assert len(timed.forwards_s) == 5
    assert 2.0 <= timed.median_ms() < 10.0
    assert len(model._forward_pre_hooks) == len(model._forward_hooks) == 1


def test_the_three_sets_are_timed_in_rotating_rounds_against_the_same_round_s_plain_step(monkeypatch, shipped_pricing):
    """Each round runs the plain step and every set once, the order rotated from round to
    round, and a set's difference is taken against the plain step of its own round: a machine
    slowing by 1 ms a step (here) puts that plain step at most three steps, 3 ms, away, and
    the rotation puts it before and after alike, so each set's median moves by 2 ms at most.
    The schedule's checks are on in every step of the rounds, and off in the walls steps and
    at the end."""
    from monet_cli.profiler import in_step
    from monet_cli.profiler.capture import Timings

    on = [False, False, False]
    order: list[int] = []
    checked: list[bool] = []
    checks = [False]
    clock = [0]

    class Machine:
        def timed_step(self) -> float:
            clock[0] += 1
            version = next((k + 1 for k, flag in enumerate(on) if flag), 0)
            order.append(version)
            checked.append(checks[0])
            return 100.0 + clock[0] + 10.0 * version

    class CallTimer:
        def __init__(self, workload: Machine) -> None:
            self.workload = workload

        def step(self) -> tuple[float, list[float]]:
            assert not any(on), "calls timed in a checkpointed step"
            assert not checks[0], "calls timed with the checks on"
            clock[0] += 1
            return 100.0, []

    def switch(k: int):
        def set_to(second: bool) -> None:
            on[k] = second

        return set_to

    monkeypatch.setattr(in_step, "CallTimer", CallTimer)
    walls = Timings()
    added = in_step._interleaved(
        Machine(), [switch(0), switch(1), switch(2)], 20, walls, lambda check: checks.__setitem__(0, check)
    )
    rounds = [order[i : i + 4] for i in range(0, len(order), 4)]
    assert all(sorted(r) == [0, 1, 2, 3] for r in rounds)
    assert [r[0] for r in rounds[:4]] == [0, 1, 2, 3]  # who goes first rotates
    assert len(walls.step_ms) == -(-(len(rounds) - in_step.WARM_UP_PAIRS) // in_step.WALLS_EVERY)
    assert not any(on) and not checks[0]
    assert all(checked)
    assert all(abs(statistics.median(ms) - 10.0 * k) <= 2.0 for k, ms in enumerate(added, start=1)), added


def test_a_measurement_in_the_step_keeps_to_its_budget_warm_up_and_walls_steps_included(monkeypatch, shipped_pricing):
    """The pairs and their warm-up fit ``BUDGET_S``, and the three sets' rounds with theirs
    and the plain steps whose calls are timed between them three times that, whatever the
    step's length; a step too long for ``MIN_PAIRS`` is not paired."""
    from monet_cli.profiler import in_step
    from monet_cli.profiler.capture import Timings

    clock_ms = [0.0]

    class Machine:
        def __init__(self, step_ms: float) -> None:
            self.step_ms = step_ms

        def timed_step(self) -> float:
            clock_ms[0] += self.step_ms
            return self.step_ms

    class CallTimer:
        def __init__(self, workload: Machine) -> None:
            self.workload = workload

        def step(self) -> tuple[float, list[float]]:
            return self.workload.timed_step(), []

    monkeypatch.setattr(in_step, "CallTimer", CallTimer)
    paired = []
    for step_ms in (5.0, 60.0, 150.0, 250.0, 290.0, 300.0, 450.0):
        if not in_step.can_pair(step_ms, 3):
            continue
        clock_ms[0] = 0.0
        pairs = in_step._pairs(step_ms, 3)
        in_step._paired(Machine(step_ms), lambda _second: None, pairs)
        assert clock_ms[0] <= in_step.BUDGET_S * 1000.0, step_ms
        clock_ms[0] = 0.0
        in_step._interleaved(Machine(step_ms), [lambda _second: None] * 3, pairs, Timings(), lambda _on: None)
        assert clock_ms[0] <= 3 * in_step.BUDGET_S * 1000.0, step_ms  # the three sets, walls steps included
        paired.append(step_ms)
    assert paired == [5.0, 60.0, 150.0, 250.0, 290.0]


def test_a_slow_step_prices_checkpoint_on_a_few_calls_alone(monkeypatch, resnet18_profile, shipped_pricing):
    """Where the step is too slow to pair, the largest calls that fit the budget and the
    cheapest to checkpoint run alone, on copies, each checkpointed as a schedule runs it (its
    BatchNorms guarded) against the same call plain: what each adds beyond its price is split
    into a cost per frame (to ``segment_ms``) and one per re-run op (``python_op_ms``); the
    largest run under the keep policy too (``policy_op_ms``). All in the profile's time: the
    call's forward alone against its wall time in the profile says how fast the machine runs.
    The timings are stubbed with a known cost per frame, per op and per policy op."""
    from dataclasses import replace

    from monet_cli.core.segments import SegmentModel
    from monet_cli.profiler import alone

    profile = replace(resnet18_profile, overheads=replace(resnet18_profile.overheads, python_op_ms=0.0))
    model = SegmentModel(profile)
    workload = build_workload(small_spec(), CPU)
    fqn_of = {id(m): name for name, m in workload.model.named_modules()}
    index = {model.calls[c].fqn: c for c in model.segments}
    speed, frame_ms, op_ms, policy_op_ms = 1.5, 0.6, 0.05, 0.03
    timed: list[tuple[str, int]] = []

    def ms(kind: str, module: torch.nn.Module, call: int) -> float:
        wall = profile.calls[call].time_ms
        if kind == "forward":
            return speed * wall
        forward = module.__dict__.get("forward")
        if forward is None:
            return speed * 3 * wall
        bns = [m for m in module.modules() if isinstance(m, torch.nn.BatchNorm2d)]
        assert all(getattr(m, "_monet_guarded", False) for m in bns), "BatchNorms unguarded"
        ops = model.segments[call].stop - model.segments[call].first_op
        added = model.added_ms(call) + frame_ms + op_ms * ops + (policy_op_ms * 2 * ops if forward.selective else 0)
        return speed * (3 * wall + added)

    def interleaved(runs, _workload, rounds):
        timed.extend((fqn, rounds) for _, _, fqn in runs[:1])
        return [[ms(kind, module, index[fqn]) for kind, module, fqn in runs]] * rounds

    monkeypatch.setattr(alone, "inputs_of", lambda _workload, modules: [fqn_of[id(m)] for m in modules])
    monkeypatch.setattr(alone, "forward_of", lambda module, fqn: ("forward", module, fqn))
    monkeypatch.setattr(alone, "step_of", lambda module, fqn: ("step", module, fqn))
    monkeypatch.setattr(alone, "interleaved", interleaved)
    monkeypatch.setattr(alone, "checkpointed_forward", _stub_checkpointed_forward)
    priced = alone.price_alone(workload, profile)
    assert priced.segment_ms == pytest.approx(profile.overheads.segment_ms + frame_ms, abs=1e-5)
    assert priced.python_op_ms == pytest.approx(op_ms, abs=1e-6)
    assert priced.policy_op_ms == pytest.approx(policy_op_ms, abs=1e-6)
    assert priced.first_frame_ms == profile.overheads.first_frame_ms
    assert [rounds for _, rounds in timed[::2]] == [1] * (alone.LARGEST + alone.CHEAPEST)  # warm-ups
    chosen = [fqn for fqn, _ in timed[1::2]]
    assert all(alone.MIN_ROUNDS <= rounds <= alone.MAX_ROUNDS for _, rounds in timed[1::2])
    ops = {fqn: model.segments[index[fqn]].end_op - model.segments[index[fqn]].first_op for fqn in chosen}
    assert min(ops[f] for f in chosen[: alone.LARGEST]) >= max(ops[f] for f in chosen[alone.LARGEST :])
    assert not any("forward" in m.__dict__ or m._forward_hooks for m in workload.model.modules()), "model changed"


def test_calls_timed_alone_run_on_copies_and_leave_the_model_as_it_was(resnet18_profile):
    from monet_cli.profiler import alone

    workload = build_workload(small_spec(), CPU)
    state = {k: v.clone() for k, v in workload.model.state_dict().items()}
    priced = alone.price_alone(workload, resnet18_profile)
    assert priced.segment_ms >= resnet18_profile.overheads.segment_ms
    assert priced.python_op_ms >= 0 and priced.policy_op_ms >= 0
    assert not any(
        "forward" in m.__dict__ or m._forward_hooks or m._forward_pre_hooks for m in workload.model.modules()
    )
    after = workload.model.state_dict()
    assert all(torch.equal(state[k], after[k]) for k in state), "the model's own BatchNorm statistics moved"


def test_calls_alone_that_re_run_nothing_leave_the_policy_its_generic_price(monkeypatch, resnet18_profile):
    """A call whose recompute stops before its first op (a single convolution) prices a frame,
    but no op runs under the policy: ``policy_op_ms`` keeps the chain's price."""
    from monet_cli.profiler import alone

    calls = [c for c in resnet18_profile.calls if c.parent is not None][:3]
    monkeypatch.setattr(alone, "_chosen", lambda _model: [c.index for c in calls])
    timed = lambda _w, _m, _c, _module, _inputs, *, policy: alone._Alone(  # noqa: E731
        ops=0, unpriced_ms=0.8, policy_ms=0.5 if policy else None
    )
    monkeypatch.setattr(alone, "_timed", timed)
    monkeypatch.setattr(alone, "inputs_of", lambda _workload, modules: [None] * len(modules))
    priced = alone.price_alone(build_workload(small_spec(), CPU), resnet18_profile)
    assert priced.policy_op_ms == resnet18_profile.overheads.policy_op_ms
    assert priced.segment_ms == pytest.approx(resnet18_profile.overheads.segment_ms + 0.8, abs=1e-6)
    assert priced.python_op_ms == 0.0


def test_frame_and_op_prices_are_a_line_through_what_calls_added_alone():
    from monet_cli.profiler.alone import frame_and_op_ms

    assert frame_and_op_ms([(0, 0.5), (10, 1.5), (20, 2.5)]) == pytest.approx((0.5, 0.1))
    assert frame_and_op_ms([(0, 2.0), (20, 1.0)]) == pytest.approx((1.5, 0.0))  # a falling line: frames alone
    assert frame_and_op_ms([(10, 0.5), (20, 2.5)]) == pytest.approx((0.0, 2.5 * 20 / 500 + 0.5 * 10 / 500))
    assert frame_and_op_ms([(16, 2.0), (16, 3.0)]) == pytest.approx((2.5, 0.0))  # one op count: frames alone
    assert frame_and_op_ms([(0, -1.0), (0, -0.5)]) == (0.0, 0.0)


def test_the_profile_times_calls_once_the_step_time_settles():
    """Plain steps run until the last three lie within 25% of each other (a fresh process, or
    one whose memory other steps churned, runs slow at first), at most 20."""
    from monet_cli.profiler.run import settle

    class Steps:
        def __init__(self, times):
            self.times = iter(times)

        def timed_step(self):
            return next(self.times)

    assert len(settle(Steps([300.0, 180.0, 95.0, 90.0, 150.0, 92.0, 88.0, 91.0, 500.0]))) == 8
    assert len(settle(Steps([100.0, 200.0] * 20))) == 20


def test_short_steps_are_timed_several_times_per_step_asked_for():
    """As many as fit in the timing budget (3 s), 1 to 5 per ``--steps``."""
    from monet_cli.profiler.run import steps_per_tick

    assert steps_per_tick(3, 50.0) == 5
    assert steps_per_tick(3, 400.0) == 2
    assert steps_per_tick(3, 1400.0) == 1
    assert steps_per_tick(1, 700.0) == 4


def test_a_schedule_s_overhead_is_taken_against_the_model_as_written(resnet18_profile, monkeypatch, tmp_path):
    """Every schedule runs in-place activations out of place (selective checkpointing cannot keep
    what an in-place op wrote); the user's model runs them in place. The profile times the step
    with the switched modules back in place, paired with the prepared one, in the profile's
    time; a schedule's overhead is taken against that step, and its step time holds the
    difference. Where nothing was switched, or the step is too slow to pair, only the
    prepared step is there to take it against. (The step is a stub: timings are the
    benchmarks' business.)"""
    from dataclasses import replace

    from monet_cli.core.schedule import consistency_problem, load_schedule, save_schedule
    from monet_cli.core.segments import SegmentModel
    from monet_cli.profiler.in_step import as_written_step_ms

    workload = build_workload(small_spec(), CPU)
    switched = workload.out_of_place
    assert switched and not any(module.inplace for module in switched)

    def step(*_args, **_kwargs) -> float:
        in_place = {module.inplace for module in switched}
        assert len(in_place) == 1, "switched one by one"
        return 10.0 if in_place.pop() else 11.0  # out of place: 1 ms more, on a machine twice as slow

    monkeypatch.setattr(workload, "timed_step", step)
    assert as_written_step_ms(workload, 22.0, 3) == pytest.approx(20.0)
    assert not any(module.inplace for module in switched)
    assert as_written_step_ms(replace(workload, out_of_place=()), 22.0, 3) is None
    assert as_written_step_ms(workload, 5000.0, 3) is None

    baseline = replace(resnet18_profile.baseline, step_ms=22.0, as_written_step_ms=20.0)
    profile = replace(resnet18_profile, baseline=baseline)
    model = SegmentModel(profile)
    call = next(c for c, seg in model.segments.items() if seg.burst_pos is not None)
    schedule = plan_schedule(profile, {call: frozenset()}, peaks=1, model=model)
    pred = schedule.predicted
    assert pred.baseline_step_ms == 20.0 and pred.preparation_ms == pytest.approx(2.0)
    added_ms = model.added_ms(call) + profile.overheads.first_frame_ms + profile.overheads.checks_ms
    assert pred.overhead == pytest.approx((22.0 + added_ms) / 20.0 - 1.0, abs=1e-5)
    save_schedule(schedule, tmp_path / "s.yaml")
    assert consistency_problem(load_schedule(tmp_path / "s.yaml")) is None
    assert resnet18_profile.baseline.as_written_step_ms > 0  # the profile measures it (resnet18's ReLUs run in place)
