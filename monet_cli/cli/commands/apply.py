"""``monet apply``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from monet_cli.cli.errors import user_errors
from monet_cli.cli.options import EXIT_CODES_HELP, JsonOutput

HELP = (
    "Run a schedule on a real training step next to the unmodified model: measured vs predicted peak, "
    "step time, and with --check gradient, parameter and BatchNorm-buffer equality.\n\n"
    "Exits 7 when the measured peak is over the budget or gradients differ, 5 when the schedule does not "
    "match the model.\n\nExample:\n\n  monet apply schedules/resnet50-60pct.yaml --check\n\n" + EXIT_CODES_HELP
)


def apply(
    schedule: Annotated[
        Optional[Path], typer.Argument(help="Schedule to apply. Default: the newest schedules/*.yaml.")
    ] = None,
    steps: Annotated[int, typer.Option(help="Timed steps per model after the first; times are medians.")] = 3,
    check: Annotated[bool, typer.Option("--check", help="Also compare gradients, parameters and BN buffers.")] = False,
    device: Annotated[
        Optional[str], typer.Option(help="cpu, cuda or cuda:N. Default: the device type the schedule was made for.")
    ] = None,
    timeline: Annotated[
        Optional[Path], typer.Option(help="Write measured (and predicted) memory timelines (.html, .png, .svg).")
    ] = None,
    profile: Annotated[
        Optional[Path],
        typer.Option(
            help="The schedule's profile, to price the schedule again at this run's speed and for the predicted "
            "timeline. Default: found in configs/ by its sha256."
        ),
    ] = None,
    json_output: JsonOutput = False,
) -> None:
    from monet_cli.cli import apply_cmd

    with user_errors():
        apply_cmd.run(
            apply_cmd.ApplyArgs(
                schedule=schedule,
                steps=steps,
                check=check,
                device=device,
                json_output=json_output,
                timeline=timeline,
                profile=profile,
            )
        )
