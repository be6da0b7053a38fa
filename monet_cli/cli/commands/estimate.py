"""``monet estimate``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from monet_cli.cli.errors import user_errors
from monet_cli.cli.options import (
    EXIT_CODES_HELP,
    BatchSize,
    Device,
    InputDtype,
    InputRange,
    InputShape,
    JsonOutput,
    ModelArg,
    OptimizerName,
    PrecisionOption,
    Workers,
)

HELP = (
    "Without solving: parameters, gradients, optimizer state, activations kept for backward, the baseline "
    "peak and the smallest peak any schedule can reach. MODEL is profiled first (same options as "
    "monet profile); a PROFILE file is read as is. --fits SIZE exits 0 when it fits as it is, 0 with a note "
    "when it fits only with a schedule, 7 when it cannot fit, 4 when the search for the smallest peak ran out "
    "of --time-limit before it could tell; --fits auto uses the device's free memory.\n\n"
    "Example:\n\n  monet estimate resnet50 -b 32 -i 3,128,128 --fits 8G\n\n" + EXIT_CODES_HELP
)


def estimate(
    target: Annotated[str, typer.Argument(help="A profile file, or a model as for monet profile.")],
    fits: Annotated[Optional[str], typer.Option(help="Memory to fit in, e.g. 8G, 16GiB, or auto.")] = None,
    batch_size: BatchSize = None,
    input_shape: InputShape = None,
    input_dtype: InputDtype = None,
    input_range: InputRange = None,
    model_arg: ModelArg = None,
    device: Device = "auto",
    optimizer: OptimizerName = None,
    precision: PrecisionOption = None,
    time_limit: Annotated[
        float, typer.Option("--time-limit", help="Seconds for the search for the smallest peak.")
    ] = 10.0,
    workers: Workers = None,
    json_output: JsonOutput = False,
) -> None:
    from monet_cli.cli import estimate_cmd, solve_cmd
    from monet_cli.cli.render import print_json, print_pairs, stderr

    with user_errors():
        workers = solve_cmd.workers_or_default(workers)
        if estimate_cmd.is_profile_file(target):
            from monet_cli.core.profile import load_profile

            profile = load_profile(Path(target))
        else:
            from monet_cli.cli import profile_cmd

            profile = profile_cmd.profile_only(
                profile_cmd.ProfileArgs(
                    model=target,
                    batch_size=batch_size,
                    input_shapes=input_shape or [],
                    input_dtypes=input_dtype or [],
                    input_range=input_range,
                    model_args=model_arg or [],
                    device=device,
                    optimizer=optimizer,
                    lr=None,
                    loss=None,
                    steps=1,
                    seed=None,
                    output=None,
                    json_output=json_output,
                    precision=precision,
                )
            )
        result = estimate_cmd.estimate(profile, target, fits, time_limit_s=time_limit, workers=workers)
        if json_output:
            print_json(estimate_cmd.as_dict(result))
        else:
            print_pairs(f"monet estimate: {profile.model.name}", estimate_cmd.as_dict(result))
        line = estimate_cmd.verdict_line(result)
        if line and result.verdict in ("fits", "fits-with-schedule"):
            stderr.print(line)
        estimate_cmd.raise_if_not_fitting(result)
