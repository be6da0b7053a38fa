"""``monet env`` and ``monet validate``: what this machine is, and whether a schedule fits a model."""

from __future__ import annotations

import platform
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

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
        monet=__version__,
        torch=str(torch.__version__),
        torchvision=str(torchvision.__version__),
        ortools=ortools.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        device=info.type,
        device_name=info.name,
        device_memory_bytes=info.total_memory_bytes,
        cuda=torch.version.cuda if torch.cuda.is_available() else None,
    )


@dataclass(frozen=True, kw_only=True, slots=True)
class Check:
    name: str
    status: Literal["passed", "failed", "not checked"]
    detail: str


@dataclass(frozen=True, kw_only=True, slots=True)
class Validation:
    schedule: str
    model: str
    ok: bool
    problem: str | None
    expected: dict[str, str]
    found: dict[str, str]
    """The fingerprint of the model here ({} when none could be taken)."""
    checks: tuple[Check, ...] = ()


def _workload(schedule: Schedule, model_spec: str | None, device):
    from monet_cli.workload.resolve import Overrides, resolve_model_spec
    from monet_cli.workload.step import build_workload, run_checked

    spec = schedule.model
    if model_spec is not None:
        spec = resolve_model_spec(
            model_spec,
            Overrides(batch_size=spec.batch_size, inputs=spec.inputs, loss=spec.loss, precision=spec.precision),
        )
    return run_checked(lambda: build_workload(spec, device), "building the model")


def model_fingerprint(workload):
    """Fingerprint of one training forward of the workload's model on its device (no optimizer step)."""
    from monet_cli.runtime.fingerprint import forward_fingerprint
    from monet_cli.workload.step import run_checked

    return run_checked(lambda: forward_fingerprint(workload), "forward")


def _segment_modules(schedule: Schedule, workload) -> Check:
    names = {name for name, _ in workload.model.named_modules()}
    missing = [path for s in schedule.segments for path in s.members if path not in names]
    if missing:
        return Check(name="segment modules", status="failed", detail=f"not in the model: {', '.join(missing[:3])}")
    return Check(name="segment modules", status="passed", detail=f"all {len(schedule.segments)} found in the model")


def _offload_modules(schedule: Schedule, workload) -> list[Check]:
    if not schedule.offloads:
        return []
    names = {name for name, _ in workload.model.named_modules()}
    missing = [o.module for o in schedule.offloads if o.module not in names]
    if missing:
        return [Check(name="offload modules", status="failed", detail=f"not in the model: {', '.join(missing[:3])}")]
    return [Check(name="offload modules", status="passed", detail=f"all {len(schedule.offloads)} found in the model")]


def _variant_modules(schedule: Schedule, workload) -> list[Check]:
    """Each operator variant's modules exist, are of the kinds it runs in, and a BatchNorm's
    weight is far enough from zero to rebuild its input."""
    from monet_cli.runtime.variants import variant_ready

    if not schedule.variants:
        return []
    problems = [f"{v.module}: {problem}" for v in schedule.variants if (problem := variant_ready(workload.model, v))]
    if problems:
        return [Check(name="variant modules", status="failed", detail="; ".join(problems[:3]))]
    return [
        Check(
            name="variant modules",
            status="passed",
            detail=f"all {len(schedule.variants)} variants can run in the model",
        )
    ]


def _modules_check(schedule: Schedule, workload) -> Check:
    from monet_cli.runtime.fingerprint import model_modules_hash

    if not schedule.fingerprint.modules:
        return Check(name="module tree", status="not checked", detail="the schedule was made before monet recorded it")
    if model_modules_hash(workload.model) != schedule.fingerprint.modules:
        return Check(name="module tree", status="failed", detail="modules or their parameter shapes differ")
    return Check(name="module tree", status="passed", detail="same modules and parameter shapes")


def _hooks_check(schedule: Schedule, workload) -> Check:
    from monet_cli.runtime.fingerprint import hooks_problem

    if schedule.fingerprint.hooks is None:
        return Check(
            name="forward hooks", status="not checked", detail="the schedule was made before monet recorded them"
        )
    problem = hooks_problem(schedule.fingerprint.hooks, workload.model)
    if problem:
        return Check(name="forward hooks", status="failed", detail=problem)
    return Check(name="forward hooks", status="passed", detail="none the profile did not see")


def validate(path: Path, model_spec: str | None) -> Validation:
    """Check a schedule against a model. A schedule made on a device this machine lacks (CUDA on
    a CPU-only CI runner) is checked as far as that allows, and the rest is listed as not checked."""
    import torch

    from monet_cli.workload.step import resolve_device

    schedule = load_schedule(path)  # schema, versions, content hash: exit 6 on failure
    checks = [Check(name="file", status="passed", detail=f"schema {schedule.schema_version}, content hash")]
    made_on = schedule.fingerprint.device_type
    here = made_on == "cpu" or torch.cuda.is_available()
    workload = _workload(schedule, model_spec, resolve_device(made_on if here else "cpu"))
    checks += [
        _modules_check(schedule, workload),
        _hooks_check(schedule, workload),
        _segment_modules(schedule, workload),
        *_variant_modules(schedule, workload),
        *_offload_modules(schedule, workload),
    ]
    found = {}
    if here:
        fingerprint = model_fingerprint(workload)
        found = asdict(fingerprint)
        checks.append(_ops_check(schedule, fingerprint, f"run on {workload.device.type}"))
    else:
        checks += _checks_without_the_device(schedule, workload)
    failed = [c for c in checks if c.status == "failed"]
    return Validation(
        schedule=str(path),
        model=model_spec or schedule.model.spec,
        ok=not failed,
        problem=f"{failed[0].name}: {failed[0].detail}" if failed else None,
        expected=asdict(schedule.fingerprint),
        found=found,
        checks=tuple(checks),
    )


def _ops_check(schedule: Schedule, found, how: str) -> Check:
    from monet_cli.runtime.fingerprint import mismatch

    problem = mismatch(schedule.fingerprint, found)
    if problem:
        return Check(name="ops and shapes", status="failed", detail=problem)
    return Check(name="ops and shapes", status="passed", detail=f"same op sequence and shapes ({how})")


def _checks_without_the_device(schedule: Schedule, workload) -> list[Check]:
    """A CUDA schedule on a machine without a GPU: fake CUDA tensors run the forward."""
    from monet_cli.runtime.fingerprint import fake_cuda_fingerprint, torch_version

    expected = schedule.fingerprint
    checks = []
    if expected.torch != torch_version():
        checks.append(
            Check(
                name="torch version",
                status="not checked",
                detail=(
                    f"made with torch {expected.torch}, this is {torch_version()}: the GPU machine must run {expected.torch}"
                ),
            )
        )
    args, kwargs = workload.call_args()
    try:
        found = fake_cuda_fingerprint(workload.model, args, kwargs, workload.spec.precision)
    except Exception as err:  # whatever stops fake tensors, the check is not made; say why
        checks.append(
            Check(
                name="ops and shapes",
                status="not checked",
                detail=f"fake CUDA tensors cannot run this model here ({type(err).__name__}: {err})",
            )
        )
    else:
        if found.structure == expected.structure and found.shapes != expected.shapes:
            checks.append(
                Check(
                    name="ops and shapes",
                    status="failed",
                    detail="the model's shapes differ (fake CUDA tensors, same ops)",
                )
            )
        elif found.structure == expected.structure:
            checks.append(
                Check(
                    name="ops and shapes",
                    status="passed",
                    detail="same op sequence and shapes (fake CUDA tensors, no GPU)",
                )
            )
        else:
            checks.append(
                Check(
                    name="ops and shapes",
                    status="not checked",
                    detail=(
                        "fake CUDA tensors ran other ops than the profiled GPU: PyTorch picks some kernels (fused "
                        "attention) by asking the GPU, so this cannot tell a changed model from a kernel choice"
                    ),
                )
            )
    checks.append(
        Check(
            name="memory, time and gradients",
            status="not checked",
            detail="need the GPU: run monet apply --check there",
        )
    )
    return checks


def raise_if_mismatch(result: Validation) -> None:
    if not result.ok:
        raise FingerprintError(f"{result.schedule} does not match {result.model}: {result.problem}")


def as_dict(report: Any) -> dict[str, Any]:
    return asdict(report)
