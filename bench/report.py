"""Turn bench/results/*.json into docs/benchmarks.md and one trade-off plot per workload.

python bench/report.py
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.pairing import paired_ratios  # noqa: E402
from monet_cli.core.stats import median_interval  # noqa: E402
from monet_cli.core.units import format_bytes  # noqa: E402

MIB = 2**20
ACTIVATION_TARGET, OVERHEAD_TARGET = 3.0, 0.15
SAME_PEAK_TARGET = 0.10
"""The schedule-v2 issue: resnet50 at the peak of checkpointing every Bottleneck, this much faster than it."""
SOLVE_TARGET_S = {"resnet50": 30.0}
"""The schedule-v2 issue's solve-time target per workload (seconds, 2 workers); others keep 60 s."""
TIME_MODEL_POINTS = 3.0
"""The schedule-v2 issue: measured minus predicted overhead within this many points at every monet point."""
CONFIDENCE = 0.9
"""How sure the interval of a paired median is (``median_interval``)."""


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / MIB:,.1f}"


def pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:+.1f}%"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _gap(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def points_table(result: dict[str, Any]) -> str:
    lines = [
        "| method | peak MiB | x less total | activations MiB | x less activations | step ms | overhead | predicted overhead | predicted in the window | predicted MiB | prediction error | solve s | status | gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        if "error" in p:
            lines.append(f"| {p['method']} | failed: {p['error']} |" + " |" * 12)
            continue
        lines.append(
            f"| {p['method']} | {mib(p['peak_bytes'])} | {p['total_ratio']:.2f} | {mib(p['activation_bytes'])} | "
            f"{p['activation_ratio']:.2f} | {p['step_ms']:.1f} | {pct(p['overhead'])} | {pct(p.get('predicted_overhead'))} | "
            f"{pct(p.get('predicted_overhead_in_window'))} | {mib(p.get('predicted_peak_bytes'))} | {pct(p.get('prediction_error'))} | "
            f"{_num(p.get('solve_time_s'))} | {p.get('status', '-')} | {_gap(p.get('gap'))} |"
        )
    return "\n".join(lines)


def _axes() -> tuple[Any, Any] | None:
    """A new figure and its axes, or None when matplotlib (the ``bench`` extra) is missing."""
    try:
        import matplotlib
    except ImportError:
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(7, 4.5))


def _save(fig: Any, ax: Any, title: str, path: Path) -> None:
    """Label the axes of an overhead-vs-peak plot and write it."""
    import matplotlib.pyplot as plt

    ax.set_xlabel("measured peak memory (MiB)")
    ax.set_ylabel("step-time overhead vs no checkpointing (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot(result: dict[str, Any], path: Path) -> bool:
    """Draw the trade-off curve; False when matplotlib is missing."""
    drawn = _axes()
    if drawn is None:
        return False
    fig, ax = drawn
    styles = {
        "baseline": ("black", "s"),
        "pytorch": ("tab:orange", "^"),
        "compile": ("tab:green", "D"),
        "monet": ("tab:blue", "o"),
    }
    for kind, (color, marker) in styles.items():
        pts = [p for p in result["points"] if p.get("kind") == kind and "peak_bytes" in p]
        if not pts:
            continue
        pts.sort(key=lambda p: p["peak_bytes"])
        xs = [p["peak_bytes"] / MIB for p in pts]
        ys = [100 * p["overhead"] for p in pts]
        ax.plot(xs, ys, marker=marker, color=color, linestyle="-" if kind == "monet" else "none", label=kind)
        if kind != "monet":
            for p, x, y in zip(pts, xs, ys):
                ax.annotate(p["method"], (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
    _save(fig, ax, f"{result['workload']} on {result['device']}: overhead vs peak memory", path)
    return True


def targets(result: dict[str, Any]) -> list[str]:
    """Each target as met / not met, with the numbers behind it."""
    pts = [p for p in result["points"] if "peak_bytes" in p]
    monet = [p for p in pts if p["kind"] == "monet"]
    torch_pts = [p for p in pts if p["kind"] in ("pytorch", "compile")]
    lines = []
    for p in torch_pts:
        fits = [m for m in monet if m["peak_bytes"] <= p["peak_bytes"]]
        if fits:
            fastest = min(fits, key=lambda m: m["step_ms"])
            met = fastest["overhead"] <= p["overhead"]  # compile points have their own baseline's timing
            lines.append(
                f"- vs {p['method']} ({mib(p['peak_bytes'])} MiB, {pct(p['overhead'])}): fastest monet at or "
                f"below that peak is {fastest['method']} at {pct(fastest['overhead'])}: "
                f"{'**met**' if met else '**not met**'} (time)"
            )
        else:
            lines.append(
                f"- vs {p['method']} ({mib(p['peak_bytes'])} MiB): no monet point reaches that peak: **not met**"
            )
        same_peak = next((m for m in monet if m["method"] == f"monet at {p['method']}"), None)
        if same_peak is not None:
            # Paired per repeat: a slow spell slows both.
            per_repeat = [1 - ratio for ratio in paired_ratios(same_peak["step_ms_all"], p["step_ms_all"])]
            faster, (low, high) = statistics.median(per_repeat), median_interval(per_repeat, CONFIDENCE)
            how = f" (paired per repeat: {CONFIDENCE:.0%} interval {100 * low:+.1f}% to {100 * high:+.1f}%)"
            verdict = ""
            if p["method"] == "ckpt every block" and result["workload"] == "resnet50":
                verdict = f"; target 10% faster: {'**met**' if faster >= SAME_PEAK_TARGET else '**not met**'}"
                if faster < SAME_PEAK_TARGET <= high:
                    verdict += ", inside the noise"
                if p.get("predicted_overhead") is not None:
                    predicted = 1 - (1 + same_peak["predicted_overhead"]) / (1 + p["predicted_overhead"])
                    verdict += (
                        f"; the time model predicted {100 * predicted:.1f}% faster ({pct(same_peak['predicted_overhead'])} "
                        f"against {pct(p['predicted_overhead'])})"
                    )
            lines.append(
                f"  - solved for that peak: {same_peak['method']} ({mib(same_peak['peak_bytes'])} MiB) is "
                f"{100 * abs(faster):.1f}% {'faster' if faster >= 0 else 'slower'}{how}{verdict}"
            )
        cheaper = [m for m in monet if m["overhead"] <= p["overhead"]]
        if cheaper:
            lowest = min(cheaper, key=lambda m: m["peak_bytes"])
            ratio = p["peak_bytes"] / lowest["peak_bytes"]
            lines.append(
                f"  - at equal or lower overhead monet reaches {mib(lowest['peak_bytes'])} MiB "
                f"({ratio:.2f}x lower; target 1.2x): {'**met**' if ratio >= 1.2 else '**not met**'}"
            )
    good = [m for m in monet if m["overhead"] <= OVERHEAD_TARGET]
    best = max(good, key=lambda m: m["activation_ratio"], default=None)
    if best is not None:
        met = best["activation_ratio"] >= ACTIVATION_TARGET
        lines.append(
            f"- activation memory at <= 15% overhead: best {best['activation_ratio']:.2f}x less "
            f"({best['method']}, {pct(best['overhead'])}); target 3x: {'**met**' if met else '**not met**'}"
        )
    else:
        lines.append("- activation memory at <= 15% overhead: no monet point within 15% overhead: **not met**")
    lines += time_model_target(monet, baseline_point(result))
    if monet and all(IN_WINDOW[0] in m for m in monet):
        lines += time_model_target(monet, baseline_point(result), *IN_WINDOW)
    errors = [abs(m["prediction_error"]) for m in monet]
    if errors:
        lines.append(
            f"- predicted peak within 2% of measured at every monet point: worst {100 * max(errors):.2f}%: "
            f"{'**met**' if max(errors) <= 0.02 else '**not met**'}"
        )
        over = [m["method"] for m in monet if not m["within_budget"]]
        lines.append(
            f"- measured never above the budget: {'**met**' if not over else '**not met**: ' + ', '.join(over)}"
        )
        limit = SOLVE_TARGET_S.get(result["workload"], 60.0)
        slow = [m for m in monet if m["solve_time_s"] > limit or (m.get("gap") or 0) > 0.01]
        longest = max(monet, key=lambda m: m["solve_time_s"])
        lines.append(
            f"- solve under {limit:.0f} s to optimum or < 1% gap: longest {longest['solve_time_s']:.2f} s "
            f"({longest['method']}): {'**met**' if not slow else '**not met** at ' + ', '.join(m['method'] for m in slow)}"
        )
    return lines


IN_WINDOW = (
    "predicted_overhead_in_window",
    "the one predicted from the profile's step and call times taken again in the bench's own repeats "
    "(`monet_cli/profiler/window.py`)",
)
"""The second prediction each point is judged by: its key in a result's points and what it is."""


def time_model_target(
    monet: list[dict[str, Any]],
    base: dict[str, Any],
    key: str = "predicted_overhead",
    against: str = "the predicted one",
) -> list[str]:
    """The time model's target, point by point: the measured overhead (the median of the
    paired per-repeat ratios to the unmodified step, ``bench/run.py``) with its interval,
    against each point's ``key`` (``against`` says what that is). A point whose prediction is
    off by more than the target but lies within the interval widened by it is inside the
    noise: this many repeats cannot tell it from a met one."""
    met, noise, missed = [], [], []
    for m in monet:
        ratios = [r - 1 for r in paired_ratios(m["step_ms_all"], base["step_ms_all"])]
        measured, (low, high) = m["overhead"], median_interval(ratios, CONFIDENCE)
        predicted, band = m[key], TIME_MODEL_POINTS / 100
        shown = f"{m['method']} {pct(measured)} ({pct(low)} to {pct(high)}) against {pct(predicted)}"
        (
            met if abs(measured - predicted) <= band else noise if low - band <= predicted <= high + band else missed
        ).append(shown)
    if not met + noise + missed:
        return []
    verdict = "**met**" if not noise + missed else "**not met**" if missed else "**not met**, inside the noise"
    lines = [
        f"- measured overhead within {TIME_MODEL_POINTS:.0f} points of {against} at every monet point "
        f"(paired per repeat with the unmodified step: median, {CONFIDENCE:.0%} interval): {verdict}; "
        f"within at {len(met)} of {len(met + noise + missed)} points"
    ]
    if noise:
        lines.append(
            f"  - off by more, inside the noise (the prediction lies within the interval widened by "
            f"{TIME_MODEL_POINTS:.0f} points): {'; '.join(noise)}"
        )
    if missed:
        lines.append(f"  - off by more, outside the noise: {'; '.join(missed)}")
    return lines


def mean_abs(values: list[float]) -> float:
    return sum(abs(v) for v in values) / len(values)


def analysis(result: dict[str, Any]) -> list[str]:
    """Measured reasons behind the time targets: prediction gap and timing noise."""
    timed = [p for p in result["points"] if p.get("predicted_overhead") is not None and "peak_bytes" in p]
    base = baseline_point(result)
    lines = []
    for kind, label in (
        ("monet", "monet points"),
        ("pytorch", "the checkpoint-every-k points (simulated as whole-block segments)"),
    ):
        gaps = [100 * (p["overhead"] - p["predicted_overhead"]) for p in timed if p["kind"] == kind]
        if gaps:
            lines.append(
                f"- measured minus predicted overhead at {label}: {min(gaps):+.1f} to {max(gaps):+.1f} points "
                f"(mean {sum(gaps) / len(gaps):+.1f}, mean absolute {mean_abs(gaps):.1f})"
            )
        before = [
            100 * (p["overhead"] - p["predicted_overhead_op_sums"])
            for p in timed
            if p["kind"] == kind and "predicted_overhead_op_sums" in p
        ]
        if before:
            lines.append(
                f"  - the same points against the time model that priced a recompute at its ops' timed sum "
                f"(before the calls' wall times): {min(before):+.1f} to {max(before):+.1f} points "
                f"(mean {sum(before) / len(before):+.1f}, mean absolute {mean_abs(before):.1f})"
            )
        window = [100 * (p["overhead"] - p[IN_WINDOW[0]]) for p in timed if p["kind"] == kind and IN_WINDOW[0] in p]
        if window:
            lines.append(
                f"  - the same points against the prediction from the profile's times taken again in the bench's "
                f"repeats: {min(window):+.1f} to {max(window):+.1f} points "
                f"(mean {sum(window) / len(window):+.1f}, mean absolute {mean_abs(window):.1f})"
            )
    if "window_step_ms" in result:
        profiled, again = result["profile"]["step_ms"], result["window_step_ms"]
        lines.append(
            f"- the machine's speed: the prepared step took {profiled:.1f} ms when profiled and {again:.1f} ms "
            f"({again / profiled:.2f}x) in the bench's repeats"
        )
    if timed:
        lines.append(
            "- the prediction counts the wall time of the forward code a recompute re-runs (each module call "
            "timed in plain steps), the checkpoint machinery priced by `monet profile` (a frame, a re-run op's "
            "extra and the selective policy timed in the model's own step where steps are short, else on a few "
            "of its calls alone) and, at "
            "monet's points, running in-place activations out of place (the overhead is taken against the "
            "model as written); "
            'where the rest goes: "Where a checkpointed step\'s added time goes" below'
        )
    noise = spread(base.get("step_ms_all") or [])
    if noise is not None:
        lines.append(f"- timing noise: the unmodified step's own repeats spread over {100 * noise:.1f}% of its median")
    if result.get("other_work_cpus") is not None:
        lines.append(
            f"- other work on the machine during the repeats: {result['other_work_cpus']:.2f} of the "
            f"{result['usable_cpus']} CPUs the bench may run on busy on average (torch ran "
            f"{result['machine']['cpus']} threads)"
        )
    return lines


def baseline_point(result: dict[str, Any]) -> dict[str, Any]:
    """The unmodified step's point of a result."""
    return next(p for p in result["points"] if p.get("kind") == "baseline")


def spread(runs: list[float]) -> float | None:
    """(slowest - fastest) / median of timed repeats; None with fewer than two."""
    if len(runs) < 2:
        return None
    return (max(runs) - min(runs)) / statistics.median(runs)


def render(
    results: list[dict[str, Any]],
    quality: dict[str, Any] | None,
    scale: dict[str, Any] | None,
    reach: dict[str, Any] | None,
    img_dir: Path,
    variants: list[dict[str, Any]] = (),
    time_gap: dict[str, Any] | None = None,
    profile_spread: dict[str, Any] | None = None,
) -> str:
    out = [
        "# Benchmarks",
        "",
        "Generated by `make bench` (`bench/run.py`, then `bench/report.py`). Every number is measured in one",
        "process on the machine below: peak memory with monet's live-storage meter (the CUDA allocator on a GPU;",
        "torch.compile points with the profiler's allocator counter, shifted onto the live-storage scale by the",
        "eager baseline measured both ways), step time as the median of interleaved repeats after a warm-up,",
        "overhead as the median over repeats of each step's time over the unmodified step's in the same repeat",
        "(torch.compile points: the ratio of the medians, against the unmodified step timed in their block).",
        '"Activations" = peak minus parameters, gradients and optimizer state.',
        "",
    ]
    if results:
        r0 = results[0]
        out += [
            "## Machine and versions",
            "",
            f"- device: {r0['device']} ({r0['device_name']}), {r0['machine']['cpus']} torch threads, {r0['machine']['platform']}",
            "- " + ", ".join(f"{k} {v}" for k, v in r0["env"].items()),
        ]
        if r0["machine"].get("host_memory_kept"):
            out += [
                "- host memory: glibc's malloc keeps what steps free (no mmap, no trim; set by the profile, as "
                "`monet profile` does), so no step re-faults its pages in"
            ]
        out += [""]
    for result in results:
        name = f"{result['workload']}-{result['device']}"
        drawn = plot(result, img_dir / f"{name}.png")
        spec = result["spec"]
        out += [
            f"## {result['workload']} ({result['device']})",
            "",
            f"{spec['model']}, batch {spec['batch_size']}, input {spec['inputs']}, {spec['optimizer']}; "
            f"{result['profile']['forward_ops']} forward ops, {result['profile']['segments']} candidate segments; "
            f"parameters + gradients + optimizer state {format_bytes(result['profile']['fixed_bytes'])}; "
            f"{result['repeats']} repeats; measured {result['created_at']}.",
            "",
            points_table(result),
            "",
            f"![{name}](img/{name}.png)" if drawn else "(plot needs matplotlib)",
            "",
            "Targets:",
            "",
            *targets(result),
            "",
            "Measured context:",
            "",
            *spread_line(profile_spread, result["workload"]),
            *analysis(result),
            "",
        ]
    if quality is not None:
        from bench.solver_quality import markdown

        out += ["## Solver quality on problems with known answers", "", markdown(quality), ""]
    if scale is not None:
        out += ["## Solve time against depth", "", scale_table(scale), ""]
    if reach is not None:
        out += ["## Reach: the smallest peak per decision family", "", reach_table(reach), ""]
    if time_gap is not None:
        out += ["## Where a checkpointed step's added time goes", "", time_gap_table(time_gap), ""]
    if profile_spread is not None:
        out += ["## How far a prediction moves with the profile", "", profile_spread_table(profile_spread), ""]
    if variants:
        out += [
            "## Operator variants against checkpointing alone",
            "",
            "`bench/variants.py`: one profile per workload, each budget solved with operator variants (the",
            "output-keeping BatchNorm and the max-pooling keeping offsets; `monet solve`'s default) and without",
            "(`--no-variants`), every schedule run and timed interleaved with the unmodified step in one process",
            "(overhead: the median over repeats of a step over the unmodified step in the same repeat); every",
            "schedule with variants also gets `apply --check`'s gradient comparison. \"x less",
            'activations" = (baseline peak - fixed) / (peak - fixed), fixed = parameters, gradients and optimizer',
            "state.",
            "",
        ]
        for result in variants:
            out += variants_section(result, img_dir)
    return "\n".join(out) + "\n"


VARIANT_CURVES = ("variants", "checkpointing only")


def variants_section(result: dict[str, Any], img_dir: Path) -> list[str]:
    """``bench/variants.py``: the curve with operator variants beside checkpointing alone."""
    name = f"variants-{result['workload']}-{result['device']}"
    spec = result["spec"]
    sites = result["profile"]["variant_sites"]
    base = baseline_point(result)
    lines = [
        f"### {result['workload']} ({result['device']})",
        "",
        f"{spec['model']}, batch {spec['batch_size']}, input {spec['inputs']}; baseline peak "
        f"{mib(base['peak_bytes'])} MiB, step {base['step_ms']:.1f} ms; {len(sites)} variant sites saving "
        f"{mib(sum(s['saves_bytes'] for s in sites))} MiB together at a measured "
        f"{sum(s['time_ms'] for s in sites):+.1f} ms per step; {result['repeats']} repeats; measured "
        f"{result['created_at']}.",
        "",
        "| curve | budget | measured MiB | predicted MiB | error | x less activations | overhead | predicted "
        "overhead | segments | keeps | variants | gradients (largest diff / largest grad) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        if p["kind"] == "baseline":
            continue
        check = p.get("check")
        grads = (
            "bit-exact schedule"
            if check is None
            else (f"{'ok' if check['ok'] and check['buffers_match'] else 'FAILED'} ({check['max_relative_diff']:.1e})")
        )
        lines.append(
            f"| {p['curve']} | {p['budget_spec']} | {mib(p['peak_bytes'])} | {mib(p['predicted_peak_bytes'])} | "
            f"{pct(p['prediction_error'])} | {p['activation_ratio']:.2f} | {pct(p['overhead'])} | "
            f"{pct(p['predicted_overhead'])} | {p['segments']} | {p['kept_ops']} | {p['variants']} | {grads} |"
        )
    drawn = _plot_variants(result, img_dir / f"{name}.png")
    lines += [
        "",
        f"![{name}](img/{name}.png)" if drawn else "(plot needs matplotlib)",
        "",
        *_variant_findings(result),
        "",
    ]
    return lines


def _variant_findings(result: dict[str, Any]) -> list[str]:
    curves = {c: [p for p in result["points"] if p.get("curve") == c] for c in VARIANT_CURVES}
    with_v, without = curves["variants"], curves["checkpointing only"]
    monet = with_v + without
    base = baseline_point(result)
    lines = [f"- {line}" for line in _gap_limit_line(monet)]
    good = [p for p in with_v if p["overhead"] <= OVERHEAD_TARGET]
    best = max(good, key=lambda p: p["activation_ratio"], default=None)
    met = best is not None and best["activation_ratio"] >= 3
    lines.append(
        "- activation memory at <= 15% measured overhead, with variants: "
        + (
            "no point"
            if best is None
            else f"{best['activation_ratio']:.2f}x ({best['budget_spec']}, {pct(best['overhead'])})"
        )
        + f"; target 3x: {'**met**' if met else '**not met**'}"
    )
    if not met:
        lines.append("  - " + _reach_reason(result, with_v))
    floor = {c: min((p["peak_bytes"] for p in pts), default=None) for c, pts in curves.items()}
    if floor["variants"] and floor["checkpointing only"]:
        lines.append(
            f"- smallest measured peak: {mib(floor['variants'])} MiB with variants, "
            f"{mib(floor['checkpointing only'])} MiB without"
        )
    lines.append(_variants_against_checkpointing(with_v, without))
    lines += time_model_target(monet, base)
    errors = [abs(p["prediction_error"]) for p in monet]
    over = [p["method"] for p in monet if not p["within_budget"]]
    checks = [p["check"] for p in with_v if p.get("check")]
    lines += [
        f"- predicted peak within 2% of measured: worst {100 * max(errors):.2f}%: "
        f"{'**met**' if max(errors) <= 0.02 else '**not met**'}",
        f"- measured peak never above the budget: {'**met**' if not over else '**not met**: ' + ', '.join(over)}",
        f"- gradients within the stated tolerance and BatchNorm statistics bit-equal at every point with variants: "
        f"{'**met**' if all(c['ok'] and c['buffers_match'] for c in checks) else '**not met**'}"
        + (
            f" (largest difference {max(c['max_relative_diff'] for c in checks):.1e} of the largest gradient)"
            if checks
            else ""
        ),
    ]
    return lines


def _variants_against_checkpointing(with_v: list[dict[str, Any]], without: list[dict[str, Any]]) -> str:
    """At each budget, the schedule with variants against the one without, paired per repeat:
    slower only where the interval of the paired median lies above zero."""
    by_budget = {v["budget_spec"]: v for v in with_v}
    slower, noisy = [], []
    for c in without:
        v = by_budget.get(c["budget_spec"])  # "min" is each curve's own floor: compared above, not here
        if c["budget_spec"] == "min" or v is None:
            continue
        ratios = [r - 1 for r in paired_ratios(v["step_ms_all"], c["step_ms_all"])]
        median, (low, high) = statistics.median(ratios), median_interval(ratios, CONFIDENCE)
        if median <= 0:
            continue
        row = f"{c['budget_spec']} ({pct(median)}, {CONFIDENCE:.0%} interval {pct(low)} to {pct(high)})"
        (slower if low > 0 else noisy).append(row)
    if slower:
        verdict = "**not met**: slower at " + "; ".join(slower)
    elif noisy:
        verdict = "**met within the noise** (the interval reaches zero): slower at " + "; ".join(noisy)
    else:
        verdict = "**met** at every budget"
    return (
        "- the curve with variants at or below checkpointing alone (at each budget, the step with variants "
        f"over the one without, paired per repeat): {verdict}"
    )


def _reach_reason(result: dict[str, Any], with_v: list[dict[str, Any]]) -> str:
    """What the variants can save at most, and how many the lowest point still runs, measured."""
    sites = result["profile"]["variant_sites"]
    base = baseline_point(result)
    activations = base["peak_bytes"] - result["profile"]["fixed_bytes"]
    saves = sum(s["saves_bytes"] for s in sites)
    floor = min(with_v, key=lambda p: p["peak_bytes"], default=None)
    at_floor = (
        ""
        if floor is None
        else (
            f"; the lowest point ({mib(floor['peak_bytes'])} MiB) runs {floor['variants']} of them beside "
            f"{floor['segments']} segments, because a variant never runs with a segment that moves its tensors, and "
            "the lowest peaks need segments"
        )
    )
    return (
        f"why: all {len(sites)} variant sites together keep {mib(saves)} MiB less, "
        f"{100 * saves / max(1, activations):.0f}% of the {mib(activations)} MiB of activations at the baseline "
        f"peak{at_floor}"
    )


def _plot_variants(result: dict[str, Any], path: Path) -> bool:
    drawn = _axes()
    if drawn is None:
        return False
    fig, ax = drawn
    base = baseline_point(result)
    ax.plot([base["peak_bytes"] / MIB], [0.0], marker="s", color="black", linestyle="none", label="no checkpointing")
    for curve, color in zip(VARIANT_CURVES, ("tab:blue", "tab:gray")):
        pts = sorted((p for p in result["points"] if p.get("curve") == curve), key=lambda p: p["peak_bytes"])
        ax.plot(
            [p["peak_bytes"] / MIB for p in pts],
            [100 * p["overhead"] for p in pts],
            marker="o",
            color=color,
            label=f"monet, {curve}",
        )
    _save(fig, ax, f"{result['workload']} on {result['device']}: operator variants", path)
    return True


def reach_table(reach: dict[str, Any]) -> str:
    """``bench/reach.py``: the floor per decision family, the lowest measured, the reach targets."""
    from bench.reach import FAMILIES, TARGETS

    families = [label for label, _, _ in FAMILIES]
    lines = [
        "`bench/reach.py`: one fresh profile per workload; the smallest peak the solver finds with module-call",
        "segments alone, then adding nesting (segments holding nested sub-segments, three levels deep, several in",
        "one), chains (one segment over a run of sibling calls, such as a ResNet's stem), op ranges (a stretch of one",
        "module's forward with its own code, such as a residual add; a range may run nested in its module's segment)",
        "and operator variants. At the last floor, the fastest plan with that peak as the budget (solved as",
        "`monet solve` does, within 1%; its status beside the overhead) is run against the unmodified model.",
        '"x less activations" = (baseline peak - fixed) / (peak - fixed), fixed = parameters, gradients and',
        "optimizer state. The gpt2 and llama rows are the real-models issue's reproductions (batch 16 x 128",
        "tokens).",
        "",
        f"| workload | baseline | {' | '.join(families)} | measured | error | x less activations | overhead "
        "(predicted) | gradients |",
        "|---|---|" + "---|" * len(families) + "---|---|---|---|---|",
    ]
    for row in reach["rows"]:
        floors = " | ".join(f"{format_bytes(f['peak_bytes'])} ({f['activation_ratio']:.2f}x)" for f in row["floors"])
        check = "ok" if row["check_ok"] else "FAILED"
        lines.append(
            f"| {row['workload']} | {format_bytes(row['baseline_peak_bytes'])} | {floors} "
            f"| {format_bytes(row['measured_peak_bytes'])} | {100 * row['error']:+.2f}% | {row['activation_ratio']:.2f}x "
            f"| {pct(row['predicted_overhead'])}{_solved_as(row)} | {check} ({row['check_mode']}) |"
        )
    lines += ["", "Reach targets (measured floor):", ""]
    words = {
        "activation_ratio": "less activation memory",
        "baseline_fraction": "of the baseline peak",
        "below_blocks": "below the peak of checkpointing every block (that peak simulated)",
    }
    for row in reach["rows"]:
        if row["workload"] not in TARGETS:
            continue
        key, goal = TARGETS[row["workload"]]
        value = row[key]
        met = value <= goal if key == "baseline_fraction" else value >= goal
        shown = f"{100 * value:.1f}%" if key == "baseline_fraction" else f"{value:.3f}x"
        target = f"{100 * goal:.0f}%" if key == "baseline_fraction" else f"{goal:.2f}x"
        lines.append(f"- {row['workload']}: {shown} {words[key]} (target {target}): **{'met' if met else 'not met'}**")
        if not met and row.get("floor_binding_points"):
            from bench.reach import NEAR_PEAK

            lines.append(
                f"  - why: the floor's simulated step comes within {100 * NEAR_PEAK:.1f}% of its peak at "
                f"{len(row['floor_binding_points'])} points, and a lower floor must lower every one: "
                + "; ".join(row["floor_binding_points"])
            )
    return "\n".join(lines)


def _solved_as(row: dict[str, Any]) -> str:
    """How the floor's plan was solved (rows from before 12-07 ran the smallest peak's own plan)."""
    solve = row.get("floor_solve")
    return f" ({solve['status']}, {solve['time_s']:.1f} s)" if solve else ""


def time_gap_table(gap: dict[str, Any]) -> str:
    """``bench/time_gap.py``: a checkpointed step's added time, part by part, against the time model."""
    lines = [
        "`bench/time_gap.py`: every block checkpointed (no ops kept), timed interleaved with the unmodified step,",
        "phase by phase; a wrapper times each block's recompute inside backward (no dispatch mode in the way).",
        "Medians, in % of the unmodified step: measured parts of the step measured beside it, the model's parts of",
        'the step of its own profile (this machine\'s speed drifts between the two). "Recompute, model" is the',
        "wall time of the re-run blocks' forwards in the profile's plain steps (and the extra cost per re-run op",
        "the profile priced: timed on a module alone before 2026-12-04, then in the step, and since 12-05 18:40",
        'on a few calls alone where steps are too slow to pair); "machinery, model" what `monet profile` prices',
        "checkpoint itself at (a frame timed in the model's own step where steps are short, else on a few of its",
        "calls alone; its saved tensors on a synthetic chain);",
        '"forward" the added forward (checkpoint\'s frames and packing);',
        '"backward rest" the added backward time outside the recompute (unpacking, the autograd engine).',
        '"Page faults": minor faults per step (memory the OS maps afresh; on this virtual machine each costs',
        "microseconds), unmodified / checkpointed: a lower peak can need fewer, which no time model of ops sees.",
        "",
        "| workload | blocks | re-run ops | unmodified step ms | recompute, measured | recompute, model | forward "
        "| backward rest | machinery, model | added, measured | added, model | measured - model | step spread "
        "| page faults |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in gap["rows"]:
        plain, scheduled, step = row["plain"], row["scheduled"], row["plain_step_ms"]

        def share(ms: float, of: float = step) -> str:
            return f"{100 * ms / of:+.1f}%"

        added = row["scheduled_step_ms"] - step
        rest = scheduled["backward"] - plain["backward"] - scheduled["recompute"]
        model_step = row["profile_step_ms"]
        lines.append(
            f"| {row['workload']} | {row['blocks']} | {row['recomputed_ops']} | {step:.1f} | {share(scheduled['recompute'])} "
            f"| {share(row['predicted_recompute_ops_ms'], model_step)} | {share(scheduled['forward'] - plain['forward'])} "
            f"| {share(rest)} | {share(row['predicted_machinery_ms'], model_step)} | {share(added)} "
            f"| {pct(row['predicted_overhead'])} | {100 * (added / step - row['predicted_overhead']):+.1f} points "
            f"| {100 * spread(row['plain_step_ms_all']):.1f}% | {faults(plain)} / {faults(scheduled)} |"
        )
    return "\n".join(lines)


def spread_line(spread_result: dict[str, Any] | None, workload: str) -> list[str]:
    """How far fresh profiles moved the predictions of ``workload``'s plans (``bench/profile_spread.py``):
    what one profile's prediction, which the time model's target is judged on, can move by before any
    error of the model."""
    rows = [row for row in (spread_result or {"rows": []})["rows"] if row["workload"] == workload]
    if not rows:
        return []
    (row,) = rows
    moved = {point["budget"]: [100 * p["overhead"] for p in point["predicted"]] for point in row["points"]}
    budget, widest = max(moved.items(), key=lambda item: max(item[1]) - min(item[1]))
    return [
        f"- the same plans predicted by {len(row['profiles'])} fresh profiles (`bench/profile_spread.py`, "
        f"{row['created_at']}, below): one plan's predictions spread over up to {max(widest) - min(widest):.1f} "
        f"points ({budget}: {min(widest):+.1f}% to {max(widest):+.1f}%)"
    ]


def profile_spread_table(spread_result: dict[str, Any]) -> str:
    """``bench/profile_spread.py``: the same schedules predicted by several fresh profiles, against one measurement."""
    lines = [
        "`bench/profile_spread.py`: fresh profiles in a row, half before and half after one measurement; the",
        "schedules solved on the first (budgets below its smallest peak left out), timed interleaved with the",
        f"unmodified step (overhead: median of the per-repeat ratios, {CONFIDENCE:.0%} interval), and predicted by",
        "every profile. The parts are each prediction's added time, in % of its profile's step, at the smallest",
        'and largest among the profiles: "walls" the recomputes at the calls\' wall times, "operator variants"',
        "the variants' own time, the others the machinery's prices (`docs/time-model.md`).",
        "",
        "| workload | budget | segments | measured | predicted, per profile | measured - predicted | parts, low to high |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in spread_result["rows"]:
        steps = [p["step_ms"] for p in row["profiles"]]
        for point in row["points"]:
            measured, (low, high) = point["measured_overhead"], point["interval"]
            predictions = [p["overhead"] for p in point["predicted"]]
            misses = [100 * (measured - p) for p in predictions]
            parts = {
                part: [100 * p["parts_ms"][part] / step for p, step in zip(point["predicted"], steps)]
                for part in point["predicted"][0]["parts_ms"]
            }
            lines.append(
                f"| {row['workload']} | {point['budget']} | {point['segments']} | {pct(measured)} ({pct(low)} to "
                f"{pct(high)}) | {', '.join(pct(p) for p in predictions)} | {min(misses):+.1f} to {max(misses):+.1f} "
                f"points | {'; '.join(f'{part} {min(v):.1f} to {max(v):.1f}' for part, v in parts.items() if max(v) >= 0.05)} |"
            )
    for row in spread_result["rows"]:
        steps_ms = ", ".join(f"{p['step_ms']:.1f}" for p in row["profiles"])
        took_s = ", ".join(f"{p['took_s']:.0f}" for p in row["profiles"])
        lines += [
            "",
            f"{row['workload']} (finished {row['created_at']}): unmodified step {row['unmodified_step_ms']:.1f} ms "
            f"in the measurement ({row['repeats']} repeats); the profiles' steps {steps_ms} ms, in the order "
            f"they ran, taking {took_s} s.",
        ]
    return "\n".join(lines)


def faults(phases: dict[str, float]) -> str:
    return f"{phases['faults']:,.0f}" if "faults" in phases else "-"


def _gap_limit_line(rows: list[dict[str, Any]]) -> list[str]:
    """The gap at which the sweep's solves stopped (rows written before the option had none)."""
    limits = {row.get("gap_limit", 0.0) for row in rows}
    if limits == {0.0}:
        return ["Each solve ran until proven optimal or the time limit."]
    return [
        f"Each solve stopped once proven within {', '.join(f'{100 * g:g}%' for g in sorted(limits))} of the "
        "least added time (FEASIBLE with its gap, OPTIMAL where proven), as `monet solve` does by default."
    ]


SCALE_TARGETS = ((32, 30.0), (48, 60.0))
"""The issue's solve targets: (layers, seconds end to end), OPTIMAL or within 1%."""


def _scale_targets(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for depth, limit_s in SCALE_TARGETS:
        at_depth = [row for row in rows if row["depth"] == depth]
        if not at_depth:
            continue
        longest = max(at_depth, key=lambda row: row["solve_total_s"])
        met = all(row["solve_total_s"] <= limit_s and row["gap"] is not None and row["gap"] <= 0.01 for row in at_depth)
        lines.append(
            f"- {depth}-layer decoders, solve <= {limit_s:g} s, OPTIMAL or within 1%: longest "
            f"{longest['solve_total_s']:.1f} s ({longest['family']}): **{'met' if met else 'not met'}**"
        )
    return lines


def scale_table(scale: dict[str, Any]) -> str:
    """``bench/scale.py``: end-to-end solve wall time at 60% of the baseline, 2 workers."""
    lines = [
        "`bench/scale.py`: Hugging Face decoders, hidden 128, batch 4 x 64 tokens. Solve = planner set-up (linear",
        "memory model) plus the solve loop (warm start, CP-SAT on lazily added rows, simulator checks), budget 60%.",
        "INFEASIBLE means CP-SAT proved 60% below the smallest peak any schedule reaches at that depth.",
        *_gap_limit_line(scale["rows"]),
        "",
        "| family | layers | forward ops | segments | keep candidates | nested pairs | profile | set-up | solve loop "
        "| solve total | status | gap |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in scale["rows"]:
        gap = "-" if row["gap"] is None else f"{100 * row['gap']:.2f}%"
        lines.append(
            f"| {row['family']} | {row['depth']} | {row['forward_ops']:,} | {row['segments']:,} | {row['keep_candidates']:,} "
            f"| {row['nest_pairs']} "
            f"| {row['profile_s']:.1f} s | {row['planner_setup_s']:.1f} s | {row['solve_s']:.1f} s "
            f"| {row['solve_total_s']:.1f} s | {row['status']} ({row['method']}) | {gap} |"
        )
    return "\n".join([*lines, "", *_scale_targets(scale["rows"])])


def main() -> int:
    results_dir = ROOT / "bench" / "results"
    # The comparison runs of bench/run.py; bench/variants.py's have their own section.
    paths = [p for p in sorted(results_dir.glob("*-*.json")) if not p.name.startswith(("smoke", "variants-"))]
    loaded = [json.loads(p.read_text()) for p in paths]
    results = [data for data in loaded if "workload" in data]
    variants = [json.loads(p.read_text()) for p in sorted(results_dir.glob("variants-*-*.json"))]
    quality_path = results_dir / "solver-quality.json"
    quality = json.loads(quality_path.read_text()) if quality_path.exists() else None
    scale_path = results_dir / "scale-cpu.json"
    scale = json.loads(scale_path.read_text()) if scale_path.exists() else None
    reach_path = results_dir / "reach-cpu.json"
    reach = json.loads(reach_path.read_text()) if reach_path.exists() else None
    time_gap_path = results_dir / "time-gap-cpu.json"
    time_gap = json.loads(time_gap_path.read_text()) if time_gap_path.exists() else None
    spread_path = results_dir / "profile-spread-cpu.json"
    profile_spread = json.loads(spread_path.read_text()) if spread_path.exists() else None
    docs = ROOT / "docs"
    text = render(results, quality, scale, reach, docs / "img", variants, time_gap, profile_spread)
    (docs / "benchmarks.md").write_text(text)
    print(f"wrote {docs / 'benchmarks.md'} ({len(results)} workloads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
