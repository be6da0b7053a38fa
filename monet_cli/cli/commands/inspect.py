"""``monet inspect``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from monet_cli.cli.errors import user_errors
from monet_cli.cli.options import EXIT_CODES_HELP, JsonOutput

HELP = (
    "Summarise a profile or a schedule: model, device, versions, budget, predicted peak and overhead, what each "
    "segment keeps or recomputes, and the top memory holders at the peak. --timeline out.html (or .png with "
    "matplotlib) draws live memory over the step with the budget line.\n\nExample:\n\n"
    "  monet inspect schedules/resnet50-60pct.yaml --timeline timeline.html\n\n" + EXIT_CODES_HELP
)


def inspect(
    file: Annotated[Path, typer.Argument(help="A profile or a schedule.")],
    profile: Annotated[
        Optional[Path],
        typer.Option(help="The schedule's profile. Default: the configs/*.profile.yaml it was solved from."),
    ] = None,
    timeline: Annotated[Optional[Path], typer.Option(help="Write a memory timeline (.html, .png, .svg).")] = None,
    json_output: JsonOutput = False,
) -> None:
    from monet_cli.cli import inspect_cmd
    from monet_cli.cli.render import inspect_tables, print_json, stderr
    from monet_cli.core.profile import Profile

    with user_errors():
        target = inspect_cmd.load_any(file)
        source = None
        if isinstance(target, Profile):
            report = inspect_cmd.profile_report(target, file)
        else:
            found = inspect_cmd.find_profile(target, profile)
            if found is not None:
                source = found[0]
                inspect_cmd.check_schedule_matches(target, source)
            report = inspect_cmd.schedule_report(target, file, source)
        if timeline is not None:
            inspect_cmd.timeline(target, source, timeline)
        if json_output:
            print_json(report)
        else:
            inspect_tables(report)
        if timeline is not None:
            stderr.print(f"[green]wrote[/green] {timeline}")
