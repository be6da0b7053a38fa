"""Rendering results for people (rich tables on stderr/stdout) and machines (JSON)."""

from __future__ import annotations

import json
import sys
from collections import Counter
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.table import Table

from monet_cli.core.profile import Profile
from monet_cli.core.ranges import op_ranges
from monet_cli.core.schedule import Schedule
from monet_cli.core.segments import sibling_chains
from monet_cli.core.simulate import simulate
from monet_cli.core.units import format_bytes

stderr = Console(stderr=True)


# Module paths are long and have no spaces to wrap at: in a narrow terminal rich would cut
# them to "transformer.h.0…", so these columns fold them onto the next line instead.
_FOLD = {"module": "fold", "nested in": "fold", "with": "fold", "kept": "fold"}


def print_json(data: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")
    sys.stdout.flush()


def _candidates(profile: Profile) -> tuple[int, int, int]:
    """How many segments a profile offers: checkpointable module calls, chains, op ranges."""
    chains = sibling_chains(profile)
    return sum(1 for c in profile.calls if c.checkpointable), len(chains), len(op_ranges(profile, chains))


def profile_summary(profile: Profile, path: str) -> dict[str, Any]:
    """The machine-readable result of ``monet profile``."""
    mem = profile.memory
    calls, chains, ranges = _candidates(profile)
    return {
        "profile": path,
        "model": profile.model.name,
        "device": profile.device.type,
        "batch_size": profile.model.batch_size,
        "forward_ops": len(profile.ops),
        "backward_ops": len(profile.backward),
        "segments": calls,
        "chains": chains,
        "ranges": ranges,
        "baseline_peak_bytes": profile.baseline.peak_bytes,
        "step_ms": profile.baseline.step_ms,
        "as_written_step_ms": profile.baseline.as_written_step_ms,
        "other_work_cpus": profile.baseline.other_work_cpus,
        "price_noise_ms": profile.overheads.price_noise_ms,
        "param_bytes": mem.param_bytes,
        "grad_bytes": mem.grad_bytes,
        "optimizer_state_bytes": mem.optimizer_state_bytes,
        "saved_activation_bytes": mem.saved_activation_bytes,
        "fingerprint": {"structure": profile.fingerprint.structure, "shapes": profile.fingerprint.shapes},
        "simulated_baseline_peak_bytes": simulate(profile, {}).peak_bytes,
        "op_ms_sum": round(profile.op_ms_sum, 3),
    }


def describe_inputs(inputs: list[dict[str, Any]]) -> str:
    """``input_ids 128 int64, labels int64`` (per sample; the batch dimension is left out)."""
    parts = []
    for spec in inputs:
        words = [spec.get("name") or "", "x".join(map(str, spec["shape"])), spec.get("dtype", "float32")]
        parts.append(" ".join(w for w in words if w))
    return ", ".join(parts)


def rerun_note(profile: Profile) -> str | None:
    """One line when the rehearsal found module calls whose recompute would differ."""
    differ = [c for c in profile.calls if c.reason.startswith("re-running")]
    if not differ:
        return None
    return (
        f"note: {len(differ)} module call(s) cannot be checkpointed, e.g. {differ[0].fqn}: {differ[0].reason} "
        "(monet inspect on the profile lists them all)"
    )


def profile_table(profile: Profile, path: str) -> Table:
    mem = profile.memory
    calls, chains, ranges = _candidates(profile)
    table = Table(title=f"monet profile: {profile.model.name}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    rows = [
        ("model", f"{profile.model.spec} ({profile.model.target})"),
        ("device", f"{profile.device.type} ({profile.device.name})"),
        ("batch", f"{profile.model.batch_size} x {describe_inputs([asdict(i) for i in profile.model.inputs])}"),
        ("precision", profile.model.precision),
        ("ops", f"{len(profile.ops)} forward, {len(profile.backward)} backward+optimizer"),
        ("segments", f"{calls} checkpointable module calls, {chains} chains of sibling calls, {ranges} op ranges"),
        ("baseline peak", format_bytes(profile.baseline.peak_bytes) + f"  ({profile.baseline.meter})"),
        ("simulated peak", _simulated_baseline(profile)),
        ("step time", _step_time(profile)),
        ("price noise", _price_noise(profile)),
        (
            "op times",
            f"{profile.op_ms_sum:.1f} ms summed, {_ratio(profile.op_ms_sum, profile.baseline.step_ms)} of the step",
        ),
        ("parameters", format_bytes(mem.param_bytes)),
        ("gradients", format_bytes(mem.grad_bytes)),
        ("optimizer state", format_bytes(mem.optimizer_state_bytes)),
        ("kept for backward", format_bytes(mem.saved_activation_bytes)),
        ("written to", path),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


def _simulated_baseline(profile: Profile) -> str:
    """The simulator's peak of the unscheduled step beside the measured one: equal on CPU; on
    CUDA the difference is what the allocator counts beyond the model (unsplit blocks)."""
    simulated = simulate(profile, {}).peak_bytes
    gap = (simulated - profile.baseline.peak_bytes) / max(1, profile.baseline.peak_bytes)
    return f"{format_bytes(simulated)}  ({100 * gap:+.2f}% of measured)"


def _step_time(profile: Profile) -> str:
    base = profile.baseline
    line = f"{base.step_ms:.1f} ms (median of {base.steps})"
    if base.as_written_step_ms is not None:
        line += f"; {base.as_written_step_ms:.1f} ms with the activations in place, as the model is written"
    return line + _other_work(base.other_work_cpus)


def _price_noise(profile: Profile) -> str:
    """How far the step's noise alone may move a deep schedule's predicted step."""
    ms = profile.overheads.price_noise_ms
    if not ms:
        return "not measured (checkpointing priced on calls timed alone, or a profile made before it was)"
    return (
        f"+-{ms:.2f} ms at 90% ({100 * ms / profile.baseline.step_ms:.1f}% of the step): what the step's noise "
        "alone may move a deep schedule's predicted step by"
    )


def _other_work(cpus: float | None) -> str:
    """What other processes took of the CPUs while the profile ran, where read."""
    return "" if cpus is None else f"; other work kept {cpus:.2f} CPUs busy meanwhile"


def _preparation(ms: float) -> str:
    """What running in-place activations out of place adds to every schedule's step."""
    return f" as written, {ms:+.1f} ms with activations out of place" if ms else ""


def _checks(ms: float) -> str:
    """What the schedule's checks on every training forward add to its step."""
    return f", checks {ms:.2f} ms" if ms else ""


def _ratio(part: float, whole: float) -> str:
    return f"{100 * part / whole:.0f}%" if whole > 0 else "-"


def _gap(value: float | None, limit: float) -> str:
    shown = "-" if value is None else f"{100 * value:.2f}%"
    return f"{shown}  (stop at {100 * limit:g}%)" if limit > 0 else shown


def schedule_table(schedule: Schedule, path: str) -> Table:
    pred, solver = schedule.predicted, schedule.solver
    table = Table(title=f"monet solve: {schedule.model.name}", show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    kept = len(schedule.keeps)
    rows = [
        ("budget", f"{format_bytes(schedule.budget_bytes)}  ({schedule.budget_spec})"),
        ("predicted peak", f"{format_bytes(pred.peak_bytes)}  (baseline {format_bytes(pred.baseline_peak_bytes)})"),
        (
            "predicted step",
            f"{pred.step_ms:.1f} ms  (baseline {pred.baseline_step_ms:.1f} ms{_preparation(pred.preparation_ms)}"
            f"{_checks(pred.checks_ms)}, overhead {100 * pred.overhead:+.1f}%)",
        ),
        (
            "segments",
            f"{len(schedule.segments)} checkpointed ({len(schedule.chains)} "
            f"chains of sibling calls, {len(schedule.ranges)} op ranges), {kept} op outputs kept",
        ),
        ("variants", _variants_line(schedule)),
        ("offloads", _offloads_line(schedule)),
        ("solver", f"{solver.method}: {solver.status}"),
        (
            "objective / bound",
            "-"
            if solver.objective is None
            else f"{solver.objective:.3f} / {'-' if solver.bound is None else f'{solver.bound:.3f}'} ms recompute",
        ),
        ("gap", _gap(solver.gap, solver.gap_limit)),
        ("time", f"{solver.time_s:.2f} s, {solver.workers} worker(s), seed {solver.seed}"),
        ("written to", path),
    ]
    for name, value in rows:
        table.add_row(name, value)
    return table


VARIANT_NAMES = {"bn_output": "output-keeping BatchNorm", "maxpool_offsets": "max-pool keeping offsets"}


def _variants_line(schedule: Schedule) -> str:
    counts = Counter(VARIANT_NAMES.get(v.impl, v.impl) for v in schedule.variants)
    listed = ", ".join(f"{n} {name}" for name, n in counts.items()) or "none"
    tolerance = schedule.tolerance()
    if tolerance is None:
        return f"{listed} (gradients bit-exact)"
    return f"{listed} (gradients within rtol {tolerance[0]:g}, atol {tolerance[1]:g} x the largest gradient)"


def _offloads_line(schedule: Schedule) -> str:
    if not schedule.offloads:
        return "none"
    moved = format_bytes(sum(o.bytes for o in schedule.offloads))
    calls = f"{len(schedule.offloads)} call" + ("s" if len(schedule.offloads) > 1 else "")
    return f"{calls} keeping saved tensors in host memory ({moved})"


def print_pairs(title: str, data: dict[str, Any]) -> None:
    """A two-column table of a flat result (for people)."""
    table = Table(title=title, show_header=False, title_justify="left")
    table.add_column("what", style="bold")
    table.add_column("value")
    for key, value in data.items():
        shown = (
            format_bytes(value) + f" ({value} bytes)" if key.endswith("_bytes") and isinstance(value, int) else value
        )
        table.add_row(key, "-" if shown is None else str(shown))
    Console().print(table)


def inspect_tables(report: dict[str, Any]) -> None:
    """Human view of ``monet inspect``'s report."""
    console = Console()
    model = report["model"]
    head = {
        "file": report["file"],
        "kind": report["kind"],
        "model": f"{model['spec']} ({model['target']})",
        "batch": f"{model['batch_size']} x {describe_inputs(model['inputs'])}",
        "precision": model["precision"],
    }
    if report["kind"] == "monet.profile":
        head.update(
            {
                "device": f"{report['device']['type']} ({report['device']['name']})",
                "torch": report["env"]["torch"],
                "baseline peak": format_bytes(report["baseline"]["peak_bytes"]),
                "step time": f"{report['baseline']['step_ms']:.1f} ms"
                + _other_work(report["baseline"]["other_work_cpus"]),
                "ops": f"{report['forward_ops']} forward, {report['backward_ops']} backward+optimizer",
            }
        )
    else:
        pred = report["predicted"]
        head.update(
            {
                "device": report["device_type"],
                "torch": report["env"]["torch"],
                "budget": f"{format_bytes(report['budget_bytes'])} ({report['budget_spec']})",
                "predicted peak": f"{format_bytes(pred['peak_bytes'])} (baseline {format_bytes(pred['baseline_peak_bytes'])})",
                "overhead": f"{100 * pred['overhead']:+.1f}% ({pred['step_ms']:.1f} ms vs {pred['baseline_step_ms']:.1f} ms)",
                "solver": f"{report['solver']['method']}: {report['solver']['status']}",
            }
        )
    table = Table(show_header=False)
    for key, value in head.items():
        table.add_row(key, str(value))
    console.print(table)
    if report["kind"] == "monet.schedule" and report["segments"]:  # a profile's "segments" is a count
        seg = Table(title="segments (checkpointed module calls, chains and op ranges)", title_justify="left")
        for column in ("module", "nested in", "ops", "kept", "recomputed", "recompute ms"):
            seg.add_column(column, overflow=_FOLD.get(column))
        for s in report["segments"]:
            module = s["module"] if s["within"] is None else f"{s['module']}: {', '.join(s['calls'])} and its own ops"
            seg.add_row(
                module,
                s["nested_in"] or "-",
                str(s["ops"]),
                ", ".join(s["kept"]) or "-",
                "-" if s["recomputed"] is None else str(s["recomputed"]),
                f"{s['recompute_ms']:.2f}",
            )
        console.print(seg)
    variants = report.get("variants") or report.get("variant_sites")
    if variants:
        title = "operator variants" + (
            "" if report["kind"] == "monet.schedule" else ": where the solver may choose one"
        )
        table = Table(title=title, title_justify="left")
        for column in ("variant", "module", "with", "saves", "time"):
            table.add_column(column, overflow=_FOLD.get(column))
        for v in variants:
            saves = "-" if v["saves_bytes"] is None else format_bytes(v["saves_bytes"])
            table.add_row(
                VARIANT_NAMES.get(v["impl"], v["impl"]),
                v["module"],
                ", ".join(v["modules"][1:]) or "-",
                saves,
                f"{v['time_ms']:+.2f} ms",
            )
        console.print(table)
    offloads = report.get("offloads") or report.get("offload_sites")
    if offloads:
        title = "offloads" if report["kind"] == "monet.schedule" else "calls the solver may offload"
        table = Table(title=title, title_justify="left")
        for column in ("module", "moves", "time"):
            table.add_column(column, overflow=_FOLD.get(column))
        for o in offloads:
            table.add_row(o["module"] or "<model>", format_bytes(o["bytes"]), f"{o['time_ms']:+.2f} ms")
        console.print(table)
    for key, title in (
        ("not_checkpointable", "module calls monet will not checkpoint"),
        ("not_rerun_as_calls", "module calls no chain or op range re-runs"),
    ):
        if report.get(key):
            calls = Table(title=title, title_justify="left")
            calls.add_column("module", overflow="fold")
            calls.add_column("why")
            for row in report[key]:
                calls.add_row(row["module"], row["reason"])
            console.print(calls)
    if report.get("unreplayable_ops"):
        ops = Table(title="ops no op range replays", title_justify="left")
        for column in ("op", "module", "why"):
            ops.add_column(column, overflow=_FOLD.get(column))
        for row in report["unreplayable_ops"]:
            ops.add_row(f"{row['index']} {row['op']}", row["module"], row["reason"])
        console.print(ops)
    if report.get("top_memory_at_peak"):
        top = Table(title="top memory holders at the peak", title_justify="left")
        for column in ("kind", "module", "size"):
            top.add_column(column, overflow=_FOLD.get(column))
        for row in report["top_memory_at_peak"]:
            top.add_row(row["kind"], row["module"], format_bytes(row["bytes"]))
        console.print(top)
