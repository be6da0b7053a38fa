"""``monet env``."""

from __future__ import annotations

from monet_cli.cli.errors import user_errors
from monet_cli.cli.options import JsonOutput

HELP = "Versions of monet, torch, torchvision, ortools and Python, and the device with its memory."


def env(json_output: JsonOutput = False) -> None:
    from monet_cli.cli import info_cmds
    from monet_cli.cli.render import print_json, print_pairs

    with user_errors():
        report = info_cmds.as_dict(info_cmds.environment())
        if json_output:
            print_json(report)
        else:
            print_pairs("monet env", report)
