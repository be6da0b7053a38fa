"""``monet profile``: parse options into a spec, profile, write the file, report."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from monet_cli.core.profile import InputSpec, save_profile
from monet_cli.core.yamlio import check_writable
from monet_cli.errors import UsageError


@dataclass(frozen=True, kw_only=True)
class ProfileArgs:
    model: str
    batch_size: int | None
    input_shapes: list[str]
    input_dtypes: list[str]
    input_range: str | None
    model_args: list[str]
    device: str
    optimizer: str | None
    lr: float | None
    loss: str | None
    steps: int
    seed: int | None
    output: Path | None
    json_output: bool
    precision: str | None = None


def parse_inputs(shapes: list[str], dtypes: list[str], value_range: str | None) -> tuple[InputSpec, ...] | None:
    from monet_cli.workload.resolve import parse_input_range, parse_input_shape

    if not shapes:
        if dtypes or value_range:
            raise UsageError("--input-dtype and --input-range need --input-shape")
        return None
    if len(dtypes) not in (0, 1, len(shapes)):
        raise UsageError(f"give one --input-dtype, or one per --input-shape ({len(shapes)})")
    low, high = parse_input_range(value_range) if value_range else (None, None)
    specs = []
    for i, shape in enumerate(shapes):
        dtype = dtypes[i] if len(dtypes) == len(shapes) else (dtypes[0] if dtypes else "float32")
        is_int = dtype.startswith("int") or dtype == "long"
        if value_range and not is_int:
            raise UsageError(f"--input-range applies to integer inputs; input {i + 1} is {dtype}")
        specs.append(
            InputSpec(
                shape=parse_input_shape(shape), dtype=dtype, low=low if is_int else None, high=high if is_int else None
            )
        )
    return tuple(specs)


def parse_model_args(items: list[str]) -> dict[str, Any] | None:
    if not items:
        return None
    kwargs = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise UsageError(f"--model-arg '{item}': expected KEY=VALUE, e.g. num_classes=10")
        kwargs[key] = yaml.safe_load(value) if value else ""
    return kwargs


def resolve(args: ProfileArgs):
    """Options -> (model spec, device), validating everything before any model runs."""
    from monet_cli.workload.resolve import Overrides, resolve_model_spec
    from monet_cli.workload.step import check_precision, parse_dtype, resolve_device

    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, got {args.steps}")
    overrides = Overrides(
        batch_size=args.batch_size,
        inputs=parse_inputs(args.input_shapes, args.input_dtypes, args.input_range),
        optimizer=_check_optimizer(args.optimizer),
        lr=args.lr,
        loss=args.loss,
        seed=args.seed,
        model_kwargs=parse_model_args(args.model_args),
        precision=None if args.precision is None else check_precision(args.precision),
    )
    if overrides.inputs:
        for spec in overrides.inputs:
            parse_dtype(spec.dtype)
    spec = resolve_model_spec(args.model, overrides)
    return spec, resolve_device(args.device)


def profile_only(args: ProfileArgs):
    """Profile without writing a file (``monet estimate MODEL``)."""
    spec, device = resolve(args)
    return _profile_with_progress(spec, device, args.steps)


def run(args: ProfileArgs) -> None:
    from monet_cli.cli.render import print_json, profile_summary, profile_table, rerun_note, stderr

    spec, device = resolve(args)
    output = args.output or Path("configs") / f"{spec.name}.profile.yaml"
    check_writable(output)
    profile = _profile_with_progress(spec, device, args.steps)
    save_profile(profile, output)
    if args.json_output:
        print_json(profile_summary(profile, str(output)))
    else:
        from rich.console import Console

        Console().print(profile_table(profile, str(output)))
    note = rerun_note(profile)
    if note:
        stderr.print(note, markup=False)
    stderr.print(f"[green]wrote[/green] {output}")


def _check_optimizer(name: str | None) -> str | None:
    if name is not None and name not in ("sgd", "adamw", "none"):
        raise UsageError(f"--optimizer '{name}': expected sgd, adamw or none")
    return name


def _profile_with_progress(spec, device, steps: int):
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from monet_cli.cli.render import stderr
    from monet_cli.profiler.run import profile_model, profile_steps

    with Progress(
        TextColumn("[bold]profile[/bold] {task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=stderr,
        transient=False,
    ) as bar:
        task = bar.add_task(f"{spec.name} on {device}", total=profile_steps(steps))

        def advance(label: str) -> None:
            bar.update(task, advance=1, description=f"{spec.name}: {label}")

        profile = profile_model(spec, device, steps=steps, progress=advance)
        bar.update(task, completed=profile_steps(steps), description=f"{spec.name}: done")
    return profile
