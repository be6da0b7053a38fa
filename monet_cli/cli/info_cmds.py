"""``monet env`` and ``monet validate``: what this machine is, and whether a schedule fits a model."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from monet_cli import __version__
from monet_cli.core.schedule import Schedule, load_schedule
from monet_cli.errors import FingerprintError


@dataclass(frozen=True, kw_only=True, slots=True)
class EnvReport:
    monet: str
    torch: str
    torchvision: str
    ortools: str
    python: str
    platform: str
    device: str
    device_name: str
    device_memory_bytes: int
    cuda: str | None


def environment() -> EnvReport:
    import ortools
    import torch
    import torchvision

    from monet_cli.profiler.run import device_info
    from monet_cli.workload.step import resolve_device

    info = device_info(resolve_device("auto"))
    return EnvReport(
        monet=__version__, torch=str(torch.__version__), torchvision=str(torchvision.__version__),
        ortools=ortools.__version__, python=platform.python_version(), platform=platform.platform(),
        device=info.type, device_name=info.name, device_memory_bytes=info.total_memory_bytes,
        cuda=torch.version.cuda if torch.cuda.is_available() else None,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Validation:
    schedule: str
    model: str
    ok: bool
    problem: str | None
    expected: dict[str, str]
    found: dict[str, str]


def model_fingerprint(schedule: Schedule, model_spec: str | None):
    """Fingerprint of one training forward of the named model (no optimizer step)."""
    import torch

    from monet_cli.runtime.fingerprint import ModuleStack, OpSequence
    from monet_cli.workload.resolve import Overrides, resolve_model_spec
    from monet_cli.workload.step import build_workload, resolve_device, run_checked

    spec = schedule.model
    if model_spec is not None:
        inputs = spec.inputs
        spec = resolve_model_spec(model_spec, Overrides(batch_size=spec.batch_size, inputs=inputs, loss=spec.loss,
                                                        precision=spec.precision))
    device = resolve_device(schedule.fingerprint.device_type if torch.cuda.is_available() or
                            schedule.fingerprint.device_type == "cpu" else "cpu")
    workload = run_checked(lambda: build_workload(spec, device), "building the model")
    with ModuleStack(workload.model) as stack:
        sequence = OpSequence(stack)
        with sequence:
            run_checked(workload.run_model, "forward")
    return sequence.fingerprint(device.type, spec.precision)


def validate(path: Path, model_spec: str | None) -> Validation:
    from monet_cli.runtime.fingerprint import mismatch

    schedule = load_schedule(path)  # schema, versions, consistency: exit 6 on failure
    found = model_fingerprint(schedule, model_spec)
    problem = mismatch(schedule.fingerprint, found)
    return Validation(
        schedule=str(path), model=model_spec or schedule.model.spec, ok=problem is None, problem=problem,
        expected=asdict(schedule.fingerprint), found=asdict(found),
    )


def raise_if_mismatch(result: Validation) -> None:
    if not result.ok:
        raise FingerprintError(f"{result.schedule} does not match {result.model}: {result.problem}")


def as_dict(report: Any) -> dict[str, Any]:
    return asdict(report)
