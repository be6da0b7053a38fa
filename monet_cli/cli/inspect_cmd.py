"""``monet inspect``: what a profile or schedule says, and where the memory goes."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from monet_cli.core.plan import plan_of, variants_of
from monet_cli.core.profile import LOSS_MODULE, PROFILE_KIND, Profile, profile_from_data
from monet_cli.core.schedule import SCHEDULE_KIND, Schedule, file_sha256, schedule_from_data
from monet_cli.core.segments import SegmentModel, sibling_chains
from monet_cli.core.simulate import WORKSPACE, Plan, Variants, live_at_peak, simulate
from monet_cli.core.solver.linear import live_series
from monet_cli.core.yamlio import load_yaml_file
from monet_cli.errors import FileFormatError, UsageError

TOP = 10


def load_any(path: Path) -> Profile | Schedule:
    data = load_yaml_file(path)
    kind = data.get("kind")
    if kind == PROFILE_KIND:
        return profile_from_data(data, source=str(path))
    if kind == SCHEDULE_KIND:
        return schedule_from_data(data, source=str(path))
    raise FileFormatError(f"{path}: kind: expected {PROFILE_KIND} or {SCHEDULE_KIND}, got {kind!r}")


def find_profile(schedule: Schedule, explicit: Path | None) -> tuple[Profile, Path] | None:
    """The schedule's own profile: --profile, else a configs/*.profile.yaml with its sha256."""
    from monet_cli.core.profile import load_profile

    if explicit is not None:
        return load_profile(explicit), explicit
    for candidate in sorted(Path("configs").glob("*.profile.yaml")):
        if file_sha256(candidate) == schedule.profile_sha256:
            return load_profile(candidate), candidate
    return None


def top_holders(model: SegmentModel, plan: Plan, variants: Variants = frozenset()) -> list[dict[str, Any]]:
    """Largest owners of memory at the simulated peak, grouped by module and kind."""
    profile = model.with_variants(frozenset(variants)).profile
    groups: dict[tuple[str, str], int] = {}
    for sid, copy, nbytes in live_at_peak(model, plan, variants):
        storage = profile.storages[sid] if sid != WORKSPACE else None
        if storage is None:
            kind, where = "workspace", "-"
        elif copy:
            kind, where = "recomputed", profile.ops[storage.producer].module
        elif storage.kind == "activation" and storage.producer is not None and storage.producer < len(profile.ops):
            kind, where = "activation", profile.ops[storage.producer].module
        else:
            kind, where = storage.kind, "-"
        key = (kind, where or "<model>")
        groups[key] = groups.get(key, 0) + nbytes
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])[:TOP]
    return [{"kind": kind, "module": module, "bytes": nbytes} for (kind, module), nbytes in ranked]


def profile_report(profile: Profile, path: Path) -> dict[str, Any]:
    slow = sorted(profile.ops, key=lambda op: -op.time_ms)[:TOP]
    model = SegmentModel(profile)
    return {
        "file": str(path),
        "kind": profile.kind,
        "model": asdict(profile.model),
        "device": asdict(profile.device),
        "env": asdict(profile.env),
        "fingerprint": asdict(profile.fingerprint),
        "baseline": asdict(profile.baseline),
        "memory": asdict(profile.memory),
        "forward_ops": len(profile.ops),
        "backward_ops": len(profile.backward),
        "segments": sum(c.checkpointable for c in profile.calls),
        "chains": [[call.fqn for call in run] for run in sibling_chains(profile)],
        "ranges": len(model.ranges),
        # Calls that run no ops would never be worth a segment: listing them is noise.
        "not_checkpointable": [
            {"module": c.fqn or "<model>", "reason": c.reason}
            for c in profile.calls
            if c.reason and c.end_op > c.first_op
        ],
        # Why ranges and chains leave some of the model out: what their recomputes cannot repeat.
        "not_rerun_as_calls": [{"module": c.fqn, "reason": c.hooks_reason} for c in profile.calls if c.hooks_reason],
        "unreplayable_ops": [
            {"index": op.index, "op": op.op, "module": op.module or "<model>", "reason": op.unreplayable}
            for op in profile.ops
            if op.unreplayable
        ],
        "top_memory_at_peak": top_holders(model, {}),
        "slowest_ops": [
            {"index": op.index, "op": op.op, "module": op.module or LOSS_MODULE, "time_ms": op.time_ms} for op in slow
        ],
        "variant_sites": [_variant_row(v, v) for v in profile.variants],
        "transfer": None if profile.transfer is None else asdict(profile.transfer),
        "offload_sites": [
            {"module": v.module, "bytes": v.native_saved_bytes, "time_ms": v.time_ms}
            for v in model.profile.variants
            if v.impl == "offload"
        ],
    }


def _variant_row(site: Any, measured: Any | None) -> dict[str, Any]:
    """One operator variant: where it runs and, from the profile's measurement, what it saves."""
    return {
        "impl": site.impl,
        "module": site.module,
        "modules": list(site.modules),
        "saves_bytes": None if measured is None else measured.native_saved_bytes - measured.saved_bytes,
        "time_ms": site.time_ms,
    }


def schedule_report(schedule: Schedule, path: Path, profile: Profile | None) -> dict[str, Any]:
    nested_in = schedule.nested_in()
    model = None if profile is None else SegmentModel(profile)
    plan = None if model is None else plan_of(schedule, model)
    saved = _saved_ops(schedule, model)
    measured = {} if profile is None else {(v.impl, v.ops): v for v in profile.variants}
    kept = schedule.kept()
    segments = [
        {
            "module": s.module,
            "chain": list(s.chain),
            "within": s.within,
            "calls": list(s.calls),
            "nested_in": nested_in.get(s.module),
            "ops": s.end_op - s.first_op,
            "recompute_ms": s.recompute_ms,
            "kept": [f"{k.op}#{k.occurrence}" for k in schedule.kept_in(s.module)],
            "recomputed": None if saved is None else len(saved[s.call] - kept[s.call]),
        }
        for s in schedule.segments
    ]
    report = {
        "file": str(path),
        "kind": schedule.kind,
        "model": asdict(schedule.model),
        "device_type": schedule.fingerprint.device_type,
        "env": asdict(schedule.env),
        "budget_bytes": schedule.budget_bytes,
        "budget_spec": schedule.budget_spec,
        "predicted": asdict(schedule.predicted),
        "solver": asdict(schedule.solver),
        "segments": segments,
        "variants": [_variant_row(v, measured.get((v.impl, v.ops))) for v in schedule.variants],
        "offloads": [{"module": o.module, "bytes": o.bytes, "time_ms": o.time_ms} for o in schedule.offloads],
        "tolerance": schedule.tolerance(),
        "top_memory_at_peak": None,
    }
    if profile is not None:
        report["top_memory_at_peak"] = top_holders(model, plan, variants_of(schedule, profile))
    return report


def _saved_ops(schedule: Schedule, model: SegmentModel | None) -> dict[int, frozenset[int]] | None:
    """Per segment, the ops whose outputs autograd saves inside it (kept or recomputed); the
    schedule lists only what it keeps, so this needs the profile."""
    if model is None:
        return None
    return {s.call: frozenset(model.segments[s.call].candidates) for s in schedule.segments}


def timeline(target: Profile | Schedule, profile: Profile | None, out: Path) -> None:
    from monet_cli.cli.timeline import Series, write_timeline

    if isinstance(target, Profile):
        model = SegmentModel(target)
        series = [Series(label="no checkpointing (predicted)", values=live_series(model, {}))]
        write_timeline(out, f"{target.model.name}: live memory over one step", series, None)
        return
    if profile is None:
        raise UsageError("--timeline for a schedule needs its profile: pass --profile PATH")
    model = SegmentModel(profile)
    plan = plan_of(target, model)
    series = [
        Series(label="no checkpointing (predicted)", values=live_series(model, {})),
        Series(
            label=f"schedule {target.budget_spec} (predicted)",
            values=live_series(model, plan, variants_of(target, profile)),
        ),
    ]
    write_timeline(out, f"{target.model.name}: live memory over one step", series, target.budget_bytes)


def check_schedule_matches(schedule: Schedule, profile: Profile) -> None:
    if profile.fingerprint != schedule.fingerprint:
        raise UsageError("--profile: that profile was made for another model or shape than the schedule")
    model = SegmentModel(profile)
    result = simulate(profile, plan_of(schedule, model), model=model, variants=variants_of(schedule, profile))
    # A CUDA schedule solved before the simulator replayed the allocator's blocks predicted their sum.
    if schedule.predicted.peak_bytes not in (result.peak_bytes, result.requested_peak_bytes):
        raise UsageError("--profile: that profile does not reproduce the schedule's predicted peak (another run)")
