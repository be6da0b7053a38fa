"""``monet solve``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from monet_cli.cli.errors import user_errors
from monet_cli.cli.options import EXIT_CODES_HELP, JsonOutput, Workers

HELP = (
    "Choose which activations to keep or recompute so the step fits --budget, and write a schedule.\n\n"
    "Budget: 8G = 8GiB = 8 x 2^30 bytes, 8GB = 8 x 10^9, 512MiB, 500M, plain bytes, or 60% of the "
    "profile's measured baseline peak.\n\n"
    "Examples:\n\n  monet solve --budget 60%\n\n  monet solve configs/gpt.profile.yaml --budget 40MiB --time-limit 20\n\n"
    + EXIT_CODES_HELP
)


def solve(
    profile: Annotated[
        Optional[Path], typer.Argument(help="Profile to plan for. Default: the newest configs/*.profile.yaml.")
    ] = None,
    budget: Annotated[str, typer.Option("--budget", help="Peak memory budget, e.g. 8G, 512MiB or 60%.")] = "",
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Schedule file. Default: schedules/NAME-BUDGET.yaml.")
    ] = None,
    time_limit: Annotated[float, typer.Option("--time-limit", help="Solver time limit in seconds.")] = 60.0,
    gap: Annotated[
        float,
        typer.Option(
            help="Stop once the schedule's added time is proven within this fraction of the least "
            "possible (0.01 = 1%); 0: prove it optimal or run to --time-limit."
        ),
    ] = 0.01,
    workers: Workers = None,
    seed: Annotated[int, typer.Option(help="CP-SAT random seed.")] = 0,
    sweep: Annotated[
        Optional[str],
        typer.Option(
            help="Solve a range of budgets START:STOP:STEP, e.g. 90%:40%:10% or 16G:4G:2G; one schedule each."
        ),
    ] = None,
    plot: Annotated[Optional[Path], typer.Option(help="With --sweep: draw overhead vs memory (.png/.svg).")] = None,
    variants: Annotated[
        bool,
        typer.Option(
            help="Let the solver choose operator variants (output-keeping BatchNorm; gradients within a "
            "stated tolerance). --no-variants: none, bit-exact gradients (offloads stay: see --offload)."
        ),
    ] = True,
    offload: Annotated[
        bool,
        typer.Option(
            help="Let the solver move a module call's saved tensors to host memory until backward needs "
            "them (CUDA profiles only: they measure the copy speed). --no-offload: never."
        ),
    ] = True,
    json_output: JsonOutput = False,
) -> None:
    from monet_cli.cli import solve_cmd
    from monet_cli.errors import UsageError

    with user_errors():
        if bool(budget) == bool(sweep):
            raise UsageError("give either --budget (e.g. --budget 8G or 60%) or --sweep (e.g. 90%:40%:10%)")
        if plot is not None and not sweep:
            raise UsageError("--plot needs --sweep")
        if sweep and output is not None:
            raise UsageError("--output names one file; with --sweep schedules go to schedules/NAME-BUDGET.yaml")
        args = solve_cmd.SolveArgs(
            profile=profile,
            budget=budget,
            output=output,
            time_limit=time_limit,
            gap=gap,
            workers=workers,
            seed=seed,
            json_output=json_output,
            variants=variants,
            offloads=offload,
        )
        if sweep:
            solve_cmd.run_sweep(args, sweep, plot)
        else:
            solve_cmd.run(args)
