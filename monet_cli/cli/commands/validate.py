"""``monet validate``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from monet_cli.cli.errors import user_errors
from monet_cli.cli.options import EXIT_CODES_HELP, JsonOutput

HELP = (
    "Check a schedule without training: schema, versions, internal consistency, and its fingerprint "
    "against the model it names (or --model). A schedule made on CUDA is checked on a machine without a GPU as "
    "far as fake CUDA tensors allow, and what could not be checked is listed. Exit 0 when it matches, 5 when "
    "it does not, 6 when the file is unsupported or corrupt.\n\nExample:\n\n  monet validate schedules/resnet50-60pct.yaml\n\n"
    + EXIT_CODES_HELP
)


def validate(
    schedule: Annotated[Path, typer.Argument(help="Schedule file.")],
    model: Annotated[
        Optional[str], typer.Option("--model", help="Run config, torchvision name or package.module:function.")
    ] = None,
    json_output: JsonOutput = False,
) -> None:
    from monet_cli.cli import info_cmds
    from monet_cli.cli.render import print_json, stderr

    with user_errors():
        result = info_cmds.validate(schedule, model)
        if json_output:
            print_json(info_cmds.as_dict(result))
        else:
            colours = {"passed": "green", "failed": "red", "not checked": "yellow"}
            for check in result.checks:
                stderr.print(
                    f"[{colours[check.status]}]{check.status:>11}[/] {check.name}: {check.detail}", highlight=False
                )
            if result.ok:
                unchecked = sum(c.status == "not checked" for c in result.checks)
                note = f" ({unchecked} not checked, listed above)" if unchecked else ""
                stderr.print(f"[green]ok[/green] {schedule} matches {result.model}{note}")
        info_cmds.raise_if_mismatch(result)
