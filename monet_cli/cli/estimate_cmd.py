"""``monet estimate``: will it fit, before any solve? A breakdown and a verdict."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from monet_cli.core.profile import Profile
from monet_cli.core.segments import SegmentModel
from monet_cli.core.solver.search import Planner
from monet_cli.core.units import format_bytes, parse_size
from monet_cli.core.yamlio import load_yaml_file
from monet_cli.errors import NoSolutionError, OverBudgetError, UsageError

ASSUMPTIONS = (
    "peaks are measured on the profiled device: live tensor storages on CPU; on CUDA the caching allocator's "
    "blocks, op workspaces included, replayed for a schedule with the profile's allocator settings; "
    "not included: the CUDA context, what the allocator reserves beyond its blocks, other processes"
)
SHARDING = (
    "the profile describes one unsharded process; under FSDP2 each rank holds its share of parameters, "
    "gradients and optimizer state (divided by the world size) plus the all-gathered parameters of the "
    "layers running (one or two at a time), and the activations of its own batch: budgets and peaks here "
    "do not model that"
)


@dataclass(frozen=True, kw_only=True, slots=True)
class Estimate:
    source: str
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int
    saved_activation_bytes: int
    baseline_peak_bytes: int
    min_peak_bytes: int
    """The smallest peak a schedule was found to reach (CP-SAT minimising the peak, checked by
    the simulator)."""
    min_peak_lower_bound_bytes: int
    """No schedule's peak is below this; equal to ``min_peak_bytes`` but for rounding where the
    search proved its answer the smallest, lower where the time limit came first."""
    capacity_bytes: int | None
    verdict: str | None
    """fits, fits-with-schedule, does-not-fit or undetermined (with --fits): undetermined when the
    capacity lies between the lower bound and the smallest peak found."""
    assumptions: str = ASSUMPTIONS
    sharding: str = SHARDING


def is_profile_file(text: str) -> bool:
    path = Path(text)
    if path.suffix not in (".yaml", ".yml") or not path.is_file():
        return False
    return load_yaml_file(path).get("kind") == "monet.profile"


def capacity(text: str, device_type: str) -> int:
    """``--fits``: a size, or ``auto`` = the device's free memory now."""
    if text != "auto":
        return parse_size(text)
    if device_type == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise UsageError("--fits auto: the profile is for CUDA but no GPU is available here")
        free, _ = torch.cuda.mem_get_info()
        return int(free)
    return _available_host_memory()


def _available_host_memory() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise UsageError("--fits auto: cannot read this machine's available memory; give a size such as 8G")


def estimate(profile: Profile, source: str, fits: str | None, *, time_limit_s: float, workers: int) -> Estimate:
    minimum = Planner(SegmentModel(profile)).minimum_peak(time_limit_s=time_limit_s, workers=workers, seed=0)
    cap = capacity(fits, profile.device.type) if fits is not None else None
    verdict = None
    if cap is not None:
        if profile.baseline.peak_bytes <= cap:
            verdict = "fits"
        elif minimum.peak_bytes <= cap:
            verdict = "fits-with-schedule"
        elif cap < minimum.lower_bound_bytes:
            verdict = "does-not-fit"
        else:
            verdict = "undetermined"
    m = profile.memory
    return Estimate(
        source=source,
        param_bytes=m.param_bytes,
        grad_bytes=m.grad_bytes,
        optimizer_state_bytes=m.optimizer_state_bytes,
        saved_activation_bytes=m.saved_activation_bytes,
        baseline_peak_bytes=profile.baseline.peak_bytes,
        min_peak_bytes=minimum.peak_bytes,
        min_peak_lower_bound_bytes=minimum.lower_bound_bytes,
        capacity_bytes=cap,
        verdict=verdict,
    )


def verdict_line(result: Estimate) -> str | None:
    if result.verdict is None:
        return None
    cap = format_bytes(result.capacity_bytes or 0)
    if result.verdict == "fits":
        return f"fits in {cap} as it is (peak {format_bytes(result.baseline_peak_bytes)})"
    if result.verdict == "fits-with-schedule":
        return (
            f"fits in {cap} only with a schedule (baseline {format_bytes(result.baseline_peak_bytes)}, "
            f"smallest reachable {format_bytes(result.min_peak_bytes)}): run monet solve --budget {cap.replace(' ', '')}"
        )
    if result.verdict == "undetermined":
        return (
            f"cannot tell whether it fits in {cap}: the smallest peak found in the time limit is "
            f"{format_bytes(result.min_peak_bytes)}, and none is below {format_bytes(result.min_peak_lower_bound_bytes)}; "
            "raise --time-limit"
        )
    return f"does not fit in {cap}: no schedule's peak is below {format_bytes(result.min_peak_lower_bound_bytes)}"


def raise_if_not_fitting(result: Estimate) -> None:
    if result.verdict == "does-not-fit":
        raise OverBudgetError(verdict_line(result) or "does not fit")
    if result.verdict == "undetermined":
        raise NoSolutionError(verdict_line(result) or "undetermined")


def as_dict(result: Estimate) -> dict[str, Any]:
    from dataclasses import asdict

    return asdict(result)
