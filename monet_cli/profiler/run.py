"""Profile a model: run real steps, record what each op costs, return a ``Profile``."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import torch

from monet_cli import __version__
from monet_cli.core.fingerprint import model_ops, shapes_hash, structure_hash
from monet_cli.core.profile import (
    PROFILE_KIND,
    SCHEMA_VERSION,
    BackwardOp,
    Baseline,
    DeviceInfo,
    EnvInfo,
    Fingerprint,
    MemorySummary,
    ModelSpec,
    ModuleCall,
    OpRecord,
    Overheads,
    PackRecord,
    Profile,
    StorageRecord,
    other_speed,
)
from monet_cli.core.variants import find_sites
from monet_cli.errors import CheckpointConflictError, FingerprintError, ModelError
from monet_cli.profiler.alone import price_alone
from monet_cli.profiler.capture import CallTimer, LifetimeRecorder, OpTimer, StepRecorder, Timings
from monet_cli.profiler.in_step import as_written_step_ms, can_pair, price_in_step, too_noisy
from monet_cli.profiler.overheads import measure_overheads
from monet_cli.profiler.probe import probe_overheads
from monet_cli.profiler.rehearse import Rehearsal
from monet_cli.profiler.transfer import measure_transfer
from monet_cli.profiler.variants import measure_variants
from monet_cli.runtime.fingerprint import forward_fingerprint, model_hooks, model_modules_hash, warn_if_untested_torch
from monet_cli.runtime.guards import output_bytes, refuse_existing_checkpointing
from monet_cli.runtime.host_memory import keep_freed_host_memory
from monet_cli.runtime.meter import alloc_conf, measure_peak
from monet_cli.runtime.sharing import others_busy_since, read_cpu_times, warn_if_shared
from monet_cli.workload.step import Workload, build_workload, configure_cuda, make_inputs, run_checked

Progress = Callable[[str], None]

SETTLE_WINDOW = 3
SETTLE_SPREAD = 1.25
SETTLE_MAX_STEPS = 20
SETTLE_BUDGET_S = 15.0
TIMING_BUDGET_S = 3.0
"""Short steps are timed several times per ``--steps``: as many as fit in this, at most
``MAX_STEPS_PER_TICK``. On this CPU a median of 3 steps had come out up to 33% above the
median of the bench's steps that followed (tiny_gpt: 67.8 ms against 51.0), and every
in-step price, taken in the profile's step time, moved with it."""
MAX_STEPS_PER_TICK = 5


def _no_progress(label: str) -> None:
    pass


def refuse_value_dependent_ops(workload: Workload, recorder: StepRecorder) -> None:
    """A model whose ops or shapes depend on its inputs' values, not only their shapes (MoE
    routing, nonzero or unique on data): a profile records one op sequence, a schedule is made
    for it, and in a training loop the next batch runs another (whose peak nothing predicted),
    which the fingerprint check then refuses as another model. One more forward, on a second
    random batch of the same shapes, finds that at profile time."""
    seed = workload.spec.seed + 1
    other = replace(workload, inputs=make_inputs(workload.spec.inputs, workload.spec.batch_size, workload.device, seed))
    structure, shapes = _recorded_hashes(recorder)
    second = run_checked(lambda: forward_fingerprint(other), "forward")
    if (structure, shapes) != (second.structure, second.shapes):
        what = "other ops" if structure != second.structure else "ops on other shapes"
        raise FingerprintError(
            f"the model runs {what} on another batch of the same shapes (two random batches gave two op sequences: "
            "routing by value, as mixture-of-experts layers do, or nonzero/unique on the data): a schedule is made "
            "for one op sequence, and its peak cannot be promised for the others"
        )


def profile_steps(steps: int) -> int:
    """How many progress ticks ``profile_model`` reports."""
    return 11 + 2 * steps


def profile_model(
    spec: ModelSpec, device: torch.device, *, steps: int = 3, progress: Progress = _no_progress
) -> Profile:
    """Warm up, measure the peak, record one step, replay lifetimes, time ``steps`` steps, then
    rehearse the recompute of every candidate segment, price checkpointing in the step and on
    the model's own code, and time operator variants (after the plain timed steps: a re-run
    may change model state)."""
    warn_if_untested_torch()
    cpu_times = read_cpu_times()  # the whole profile: a small model's timed steps take under a second
    configure_cuda(device)
    keep_freed_host_memory()  # steps timed without the page faults glibc's history would add
    workload = run_checked(lambda: build_workload(spec, device), "building the workload")
    refuse_existing_checkpointing(workload.model)
    progress("warm-up step")
    run_checked(lambda: workload.timed_step(), "warm-up step")
    progress("measuring peak memory")
    measurement = run_checked(lambda: measure_peak(workload), "measuring step")
    progress("recording ops and memory")
    recorder = StepRecorder(workload)
    run_checked(recorder.record_step, "recording step")
    if recorder.own_saving is not None:
        raise CheckpointConflictError(
            f"monet's schedule decides what is kept and recomputed, but the model {recorder.own_saving}, "
            "which its profile cannot measure: remove that from the model's code and let the schedule decide"
        )
    refuse_value_dependent_ops(workload, recorder)
    progress("replaying activation lifetimes")
    lifetimes = LifetimeRecorder()
    run_checked(lambda: lifetimes.record_forward(workload), "lifetime pass")
    progress("measuring checkpoint overheads")
    overheads = measure_overheads(device)
    if device.type == "cuda":
        progress("measuring host-device copies")
    transfer = measure_transfer(device)
    timings = Timings()
    for i in range(steps):
        progress(f"timing ops (step {i + 1}/{steps})")
        timings.op_ms.append(run_checked(lambda: _timed_ops(workload, recorder), "timed step"))
    progress("waiting for the step time to settle")
    per_tick = steps_per_tick(steps, run_checked(lambda: settle(workload), "warm-up step")[-1])
    for i in range(steps):
        progress(f"timing steps (step {i + 1}/{steps})")
        for _ in range(per_tick):
            step_ms, call_ms = run_checked(lambda: _timed_calls(workload, recorder), "timed step")
            timings.step_ms.append(step_ms)
            timings.call_ms.append(call_ms)
    progress("timing the model as written")
    timings.as_written_step_ms = run_checked(
        lambda: as_written_step_ms(workload, timings.median_step_ms(), steps), "timed step"
    )
    reasons = structural_reasons(recorder)
    progress("rehearsing recomputes")
    # A call made several times is no segment, but an op range re-runs it as a call, hooks and all.
    made = Counter(call.fqn for call in recorder.calls)
    candidates = [c.fqn for c in recorder.calls if not reasons[c.index] or (c.parent is not None and made[c.fqn] > 1)]
    rehearsed = run_checked(lambda: Rehearsal(workload, candidates).run(), "rehearsal step")
    for call in recorder.calls:
        reasons[call.index] = reasons[call.index] or rehearsed.differs.get(call.fqn, "")
    hooks_reasons = [rehearsed.hooks_differ.get(call.fqn, "") for call in recorder.calls]
    profile = replace(
        build_profile(
            workload, recorder, lifetimes, timings, measurement.peak_bytes, measurement.meter, reasons, hooks_reasons
        ),
        overheads=overheads,
    )
    if can_pair(profile.baseline.step_ms, steps):
        progress("pricing checkpoint in the step (once, per frame, per re-run op, the policy)")
        overheads = run_checked(lambda: price_in_step(workload, profile, steps), "pricing step")
        warn_if_noisy_prices(overheads, profile.baseline.step_ms)
    else:
        progress("pricing checkpoint on a few calls alone (per frame, per re-run op, the policy)")
        overheads = run_checked(lambda: price_alone(workload, profile), "timing a module alone")
    profile = replace(profile, overheads=overheads)
    progress("pricing op ranges on the model's own code")
    profile = replace(
        profile, overheads=run_checked(lambda: probe_overheads(workload, profile), "timing a module alone")
    )
    progress("measuring operator variants")
    variants = run_checked(lambda: measure_variants(workload, find_sites(profile)), "measuring operator variants")
    progress("timing the step again (has the machine's speed changed?)")
    run_checked(lambda: warn_on_speed_change(workload, timings.step_ms), "timed step")
    other_work = others_busy_since(cpu_times) if device.type == "cpu" else None
    warn_if_shared(
        other_work,
        "the profile ran",
        "its times, and the overheads predicted from them, assume the machine to itself: "
        "profile again on a quiet machine before trusting them",
    )
    baseline = replace(profile.baseline, other_work_cpus=other_work)
    return replace(profile, baseline=baseline, transfer=transfer, variants=variants)


def warn_on_speed_change(workload: Workload, step_ms: list[float]) -> None:
    """Time as many plain steps as ``step_ms`` holds and warn when their median says the
    machine runs at another speed than the median of ``step_ms`` (the profile's step)."""
    early = statistics.median(step_ms)
    late = statistics.median([workload.timed_step() for _ in step_ms])
    if other_speed(early, late):
        warnings.warn(
            f"monet: this machine's speed changed while profiling: the plain step took {early:.1f} ms "
            f"when timed and {late:.1f} ms at the end, and the predicted overheads assume one speed; "
            "profile again on a quieter machine before trusting them",
            stacklevel=2,
        )


def warn_if_noisy_prices(overheads: Overheads, step_ms: float) -> None:
    """Warn where the step's noise alone may move a deep schedule's predicted overhead by more
    than ``in_step.NOISY_PRICES`` of the step (``Overheads.price_noise_ms``)."""
    if too_noisy(overheads.price_noise_ms, step_ms):
        warnings.warn(
            f"monet: the step's time is noisy on this machine: checkpointing's prices timed in the step "
            f"hold to +-{overheads.price_noise_ms:.1f} ms at 90% ({100 * overheads.price_noise_ms / step_ms:.1f}% "
            "of the step), so a deep schedule's predicted overhead may be off by as many points from the "
            "noise alone; profile again on a quieter machine before trusting it to a few points",
            stacklevel=2,
        )


def steps_per_tick(steps: int, step_ms: float) -> int:
    """Timed steps per ``--steps``: as many as fit in ``TIMING_BUDGET_S``, 1 to ``MAX_STEPS_PER_TICK``."""
    return max(1, min(MAX_STEPS_PER_TICK, int(TIMING_BUDGET_S * 1000.0 / (steps * max(step_ms, 1e-3)))))


def settle(workload: Workload) -> list[float]:
    """Run plain steps until the last ``SETTLE_WINDOW`` are within ``SETTLE_SPREAD`` of each
    other (at most ``SETTLE_MAX_STEPS``, or ``SETTLE_BUDGET_S``); returns their times, in ms.

    The step times a profile prices recomputes with must be the steady state's. After the
    recording and op-timed steps, whose dispatch modes make and free other tensors, a 2-core
    CPU VM ran the next plain steps 1.5-3x slower than later ones (glibc had handed the freed
    memory back, and each page faulted in again): 131-178 ms against 80-90 for tiny_gpt and
    the unet. A slow spell of the machine that lasts longer than the window passes for steady."""
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < SETTLE_MAX_STEPS and time.perf_counter() - start < SETTLE_BUDGET_S:
        times.append(workload.timed_step())
        last = times[-SETTLE_WINDOW:]
        if len(last) == SETTLE_WINDOW and max(last) <= SETTLE_SPREAD * min(last):
            break
    return times


def _timed_ops(workload: Workload, recorder: StepRecorder) -> list[float]:
    workload.zero_grad()
    timer = OpTimer(workload.device)
    with timer:
        workload.step()
    expected = [op.op for op in recorder.ops]
    if timer.names != expected:
        raise ModelError("the model ran different ops in two steps; monet needs the same ops every step")
    return timer.times_ms


def _timed_calls(workload: Workload, recorder: StepRecorder) -> tuple[float, list[float]]:
    step_ms, call_ms = CallTimer(workload).step()
    if len(call_ms) != len(recorder.calls):
        raise ModelError("the model made different module calls in two steps; monet needs the same calls every step")
    return step_ms, call_ms


# -- turning raw records into the Profile ---------------------------------------------


def _recorded_hashes(recorder: StepRecorder) -> tuple[str, str]:
    """The fingerprint's structure and shapes hashes of the recorded forward's model ops (apply()
    checks a user's model in the user's loop, which computes its own loss)."""
    fingerprinted = model_ops([op for op in recorder.ops if op.phase == "forward"], lambda op: op.module)
    return structure_hash((op.op, op.module) for op in fingerprinted), shapes_hash(op.signature for op in fingerprinted)


def build_profile(
    workload: Workload,
    recorder: StepRecorder,
    lifetimes: LifetimeRecorder,
    timings: Timings,
    peak_bytes: int,
    meter: str,
    reasons: list[str],
    hooks_reasons: list[str],
) -> Profile:
    forward = [op for op in recorder.ops if op.phase == "forward"]
    if lifetimes.ops != [op.op for op in forward]:
        raise ModelError("the model ran different ops in two forwards; monet needs the same ops every step")
    op_ms = timings.median_op_ms()
    structure, shapes = _recorded_hashes(recorder)
    storages = _storage_records(recorder, lifetimes, len(forward))
    ops = _op_records(recorder, forward, storages, op_ms)
    return Profile(
        schema_version=SCHEMA_VERSION,
        kind=PROFILE_KIND,
        model=workload.spec,
        device=device_info(workload.device),
        env=env_info(),
        fingerprint=Fingerprint(
            structure=structure,
            shapes=shapes,
            device_type=workload.device.type,
            torch=torch.__version__.split("+")[0],
            precision=workload.spec.precision,
            modules=model_modules_hash(workload.model),
            hooks=model_hooks(workload.model),
            output_bytes=output_bytes(workload.output),
        ),
        baseline=Baseline(
            peak_bytes=peak_bytes,
            step_ms=round(timings.median_step_ms(), 4),
            steps=len(timings.step_ms),
            peak_pos=recorder.peak_pos,
            meter=meter,
            as_written_step_ms=timings.as_written_step_ms,
        ),
        memory=_memory_summary(storages, ops),
        created_at=_dt.datetime.now(_dt.timezone.utc).replace(microsecond=0).isoformat(),
        ops=ops,
        backward=tuple(
            BackwardOp(
                pos=op.pos,
                op=op.op,
                phase=op.phase,
                time_ms=round(op_ms[op.pos], 4),  # type: ignore[arg-type]
                workspace_bytes=op.workspace,
            )
            for op in recorder.ops[len(forward) :]
        ),
        calls=_call_records(
            recorder, reasons, hooks_reasons, timings.median_call_ms([call.parent for call in recorder.calls])
        ),
        storages=storages,
        packs=tuple(
            PackRecord(storage=p.storage, call=p.call, pos=p.pos, unpack=p.unpack, release=p.release)
            for p in recorder.packs
        ),
    )


def _storage_records(
    recorder: StepRecorder, lifetimes: LifetimeRecorder, num_forward: int
) -> tuple[StorageRecord, ...]:
    # The k-th storage made by forward op p is the same tensor in both passes.
    slot_free: dict[tuple[int, int], int | None] = {}
    for pos, slots in enumerate(lifetimes.outputs):
        for k, slot in enumerate(slots):
            slot_free[(pos, k)] = lifetimes.free[slot]
    order_in_op: dict[int, int] = {}
    for op in recorder.ops[:num_forward]:
        for k, sid in enumerate(op.outputs):
            order_in_op[sid] = k
    records = []
    for s in recorder.storages:
        free_no_autograd = None
        if s.kind == "activation" and s.producer is not None:
            free_no_autograd = slot_free.get((s.producer, order_in_op.get(s.id, -1)))
        records.append(
            StorageRecord(
                id=s.id,
                bytes=s.bytes,
                kind=s.kind,
                producer=s.producer,
                alloc=s.alloc,  # type: ignore[arg-type]
                free=s.free,
                free_no_autograd=free_no_autograd,
                mutated=s.mutated,
                returned_to=s.returned_to if s.kind == "activation" else None,
            )
        )
    return tuple(records)


def _op_records(
    recorder: StepRecorder, forward: list, storages: tuple[StorageRecord, ...], op_ms: list[float]
) -> tuple[OpRecord, ...]:
    saved = {p.storage for p in recorder.packs}
    saved_bytes = [0] * len(forward)
    for s in storages:
        if s.kind == "activation" and s.producer is not None and s.id in saved:
            saved_bytes[s.producer] += s.bytes
    inputs: list[tuple[int, ...]] = []
    consumers: list[list[int]] = [[] for _ in forward]
    for op in forward:
        producers = sorted(
            {
                storages[sid].producer
                for sid in op.inputs
                if storages[sid].kind == "activation" and storages[sid].producer not in (None, op.pos)
            }
        )
        inputs.append(tuple(producers))  # type: ignore[arg-type]
        for producer in producers:
            consumers[producer].append(op.pos)  # type: ignore[index]
    return tuple(
        OpRecord(
            index=op.pos,
            op=op.op,
            module=op.module,
            time_ms=round(op_ms[op.pos], 4),
            out_bytes=sum(storages[sid].bytes for sid in op.outputs),
            saved_bytes=saved_bytes[op.pos],
            inplace_of=_inplace_of(op, storages),
            inputs=inputs[op.pos],
            consumers=tuple(consumers[op.pos]),
            workspace_bytes=op.workspace,
            unreplayable=op.unreplayable,
            torch_call_end=op.torch_call_end,
        )
        for op in forward
    )


def _inplace_of(op, storages: tuple[StorageRecord, ...]) -> int | None:
    for sid in op.written:
        storage = storages[sid]
        if storage.kind == "activation" and storage.producer is not None and storage.producer != op.pos:
            return storage.producer
    return None


def structural_reasons(recorder: StepRecorder) -> list[str]:
    """Per recorded call, why it cannot be a segment whatever its re-run does ("" when it can)."""
    counts: dict[str, int] = {}
    for call in recorder.calls:
        counts[call.fqn] = counts.get(call.fqn, 0) + 1
    named = set(recorder.workload.module_names.values())
    activations = {s.id for s in recorder.storages if s.kind == "activation" and s.producer is not None}
    reasons = []
    for c in recorder.calls:
        if c.parent is None:
            reasons.append("the model itself: its inputs are the step's data")
        elif c.fqn not in named:
            reasons.append("not a registered submodule: monet finds segments by module path")
        elif counts[c.fqn] > 1:
            reasons.append(f"called {counts[c.fqn]} times in one step (shared weights)")
        elif c.end_op <= c.first_op:
            reasons.append("runs no ops")
        elif _writes_earlier_activation(recorder, activations, c.first_op, c.end_op):
            reasons.append("writes in place to a tensor made before it: a recompute would read the written value")
        else:
            reasons.append("")
    return reasons


def _writes_earlier_activation(recorder: StepRecorder, activations: set[int], first: int, end: int) -> bool:
    return any(
        sid in activations and recorder.storages[sid].producer < first
        for op in recorder.ops[first:end]
        for sid in op.written
    )


def _call_records(
    recorder: StepRecorder, reasons: list[str], hooks_reasons: list[str], call_ms: list[float]
) -> tuple[ModuleCall, ...]:
    return tuple(
        ModuleCall(
            index=c.index,
            fqn=c.fqn,
            type=c.type,
            first_op=c.first_op,
            end_op=c.end_op,
            parent=c.parent,
            checkpointable=not reasons[c.index],
            inputs=tuple(c.inputs),
            hand_off=c.hand_off,
            reason=reasons[c.index],
            hooks_reason=hooks_reasons[c.index],
            time_ms=round(call_ms[c.index], 4),
        )
        for c in recorder.calls
    )


def _memory_summary(storages: tuple[StorageRecord, ...], ops: tuple[OpRecord, ...]) -> MemorySummary:
    def total(kind: str) -> int:
        return sum(s.bytes for s in storages if s.kind == kind)

    return MemorySummary(
        param_bytes=total("param"),
        buffer_bytes=total("buffer"),
        input_bytes=total("input"),
        grad_bytes=total("grad"),
        optimizer_state_bytes=total("optimizer"),
        saved_activation_bytes=sum(op.saved_bytes for op in ops),
    )


def device_info(device: torch.device) -> DeviceInfo:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return DeviceInfo(
            type="cuda", name=props.name, total_memory_bytes=int(props.total_memory), alloc_conf=alloc_conf()
        )
    try:
        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        total = 0
    return DeviceInfo(
        type="cpu", name=platform.processor() or platform.machine() or "cpu", total_memory_bytes=int(total)
    )


def env_info() -> EnvInfo:
    import ortools
    import torchvision

    return EnvInfo(
        monet=__version__,
        torch=torch.__version__,
        torchvision=torchvision.__version__,
        ortools=ortools.__version__,
        python=platform.python_version(),
    )
