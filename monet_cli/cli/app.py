"""The ``monet`` command line: a thin typer layer over functions that return dataclasses.

Each command lives in its own module under ``commands/`` with its help and options; this
module only gathers them, in the order ``monet --help`` lists them.
"""

from __future__ import annotations

import warnings
from typing import Annotated

import typer

from monet_cli import __version__
from monet_cli.cli.commands import apply, env, estimate, inspect, profile, solve, validate
from monet_cli.cli.errors import show_warning
from monet_cli.cli.options import EXIT_CODES_HELP

app = typer.Typer(
    name="monet",
    help=(
        "Plan activation checkpointing so a PyTorch training step fits a memory budget.\n\n"
        "Workflow: monet profile MODEL -> monet solve --budget 8G -> monet apply.\n\n"
        "Sizes: 8G = 8GiB = 8 x 2^30 bytes; 8GB = 8 x 10^9 bytes; 60% = of the measured baseline peak.\n\n"
        + EXIT_CODES_HELP
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

app.command(help=profile.HELP, no_args_is_help=True)(profile.profile)
app.command(help=solve.HELP)(solve.solve)
app.command(help=apply.HELP)(apply.apply)
app.command(help=env.HELP)(env.env)
app.command(help=validate.HELP, no_args_is_help=True)(validate.validate)
app.command(help=inspect.HELP, no_args_is_help=True)(inspect.inspect)
app.command(help=estimate.HELP, no_args_is_help=True)(estimate.estimate)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"monet {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    pass


def main() -> None:
    warnings.showwarning = show_warning
    app()
