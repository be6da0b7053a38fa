"""The ``monet`` command line: a thin typer layer over functions that return dataclasses."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from monet_cli import __version__
from monet_cli.cli.errors import user_errors
from monet_cli.errors import EXIT_CODE_TABLE

EXIT_CODES_HELP = "Exit codes: " + "; ".join(f"{code} {text}" for code, text in EXIT_CODE_TABLE) + "."

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


# Options shared by the commands that build a training step (profile, estimate).
BatchSize = Annotated[Optional[int], typer.Option("--batch-size", "-b", help="Samples per step.")]
InputShape = Annotated[
    Optional[list[str]],
    typer.Option("--input-shape", "-i", help="Per-sample input shape, e.g. 3,128,128; repeat for several inputs."),
]
InputDtype = Annotated[
    Optional[list[str]],
    typer.Option("--input-dtype", help="Input dtype (float32, bfloat16, int64, ...); one, or one per input."),
]
InputRange = Annotated[
    Optional[str], typer.Option("--input-range", help="LOW:HIGH for integer inputs such as token ids, e.g. 0:50257.")
]
Device = Annotated[str, typer.Option(help="auto (CUDA when present), cpu, cuda or cuda:N.")]
OptimizerName = Annotated[Optional[str], typer.Option(help="sgd (lr 0.01, momentum 0.9), adamw or none. Default: sgd.")]
PrecisionOption = Annotated[
    Optional[str],
    typer.Option(help="32, bf16-mixed or fp16-mixed (forward and loss under torch.autocast; fp16 with a GradScaler). "
                 "Default: 32."),
]
ModelArg = Annotated[
    Optional[list[str]],
    typer.Option("--model-arg", help="KEY=VALUE passed to the model factory (hf: models: a config field); repeatable."),
]


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


@app.command(
    help=(
        "Run real training steps of MODEL and record every op's time and memory into a YAML profile.\n\n"
        "MODEL is a run config (configs/NAME.yaml or a path to a .yaml file), a torchvision model "
        "name (resnet50, vgg16, vit_b_16, ...), hf:NAME (a transformers model type, model class or "
        "config.json; no download), timm:NAME, or an import path package.module:function returning "
        "an nn.Module. Command-line options override the run config.\n\n"
        "Examples:\n\n"
        "  monet profile resnet50 --batch-size 8 --input-shape 3,128,128\n\n"
        "  monet profile monet_cli.examples.models:tiny_gpt --input-shape 64 --input-dtype int64 "
        "--input-range 0:512 --loss token_cross_entropy\n\n"
        "  monet profile hf:llama --model-arg hidden_size=256 --model-arg num_hidden_layers=4 --input-shape 128 "
        "-b 16 --precision bf16-mixed\n\n" + EXIT_CODES_HELP
    ),
    no_args_is_help=True,
)
def profile(
    model: Annotated[str, typer.Argument(help="Run config, hf:NAME, timm:NAME, torchvision name or package.module:function.")],
    batch_size: BatchSize = None,
    input_shape: InputShape = None,
    input_dtype: InputDtype = None,
    input_range: InputRange = None,
    model_arg: ModelArg = None,
    device: Device = "auto",
    optimizer: OptimizerName = None,
    precision: PrecisionOption = None,
    lr: Annotated[Optional[float], typer.Option(help="Learning rate of the optimizer.")] = None,
    loss: Annotated[
        Optional[str],
        typer.Option(help="auto, cross_entropy, token_cross_entropy, mean_square or package.module:function."),
    ] = None,
    steps: Annotated[int, typer.Option(help="Timed steps after one warm-up; times are their median.")] = 3,
    seed: Annotated[Optional[int], typer.Option(help="Seed for weights and random inputs.")] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Profile file. Default: configs/NAME.profile.yaml.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
) -> None:
    from monet_cli.cli import profile_cmd

    with user_errors():
        profile_cmd.run(
            profile_cmd.ProfileArgs(
                model=model, batch_size=batch_size, input_shapes=input_shape or [], input_dtypes=input_dtype or [],
                input_range=input_range, model_args=model_arg or [], device=device, optimizer=optimizer, lr=lr,
                loss=loss, steps=steps, seed=seed, output=output, json_output=json_output, precision=precision,
            )
        )


@app.command(
    help=(
        "Choose which activations to keep or recompute so the step fits --budget, and write a schedule.\n\n"
        "Budget: 8G = 8GiB = 8 x 2^30 bytes, 8GB = 8 x 10^9, 512MiB, 500M, plain bytes, or 60% of the "
        "profile's measured baseline peak.\n\n"
        "Examples:\n\n  monet solve --budget 60%\n\n  monet solve configs/gpt.profile.yaml --budget 40MiB --time-limit 20\n\n"
        + EXIT_CODES_HELP
    ),
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
        typer.Option(help="Stop once the schedule's added time is proven within this fraction of the least "
                          "possible (0.01 = 1%); 0: prove it optimal or run to --time-limit."),
    ] = 0.01,
    workers: Annotated[
        Optional[int], typer.Option(help="CP-SAT workers. Default: CPU cores (max 8); 1 when CI is set.")
    ] = None,
    seed: Annotated[int, typer.Option(help="CP-SAT random seed.")] = 0,
    sweep: Annotated[
        Optional[str],
        typer.Option(help="Solve a range of budgets START:STOP:STEP, e.g. 90%:40%:10% or 16G:4G:2G; one schedule each."),
    ] = None,
    plot: Annotated[Optional[Path], typer.Option(help="With --sweep: draw overhead vs memory (.png/.svg).")] = None,
    variants: Annotated[
        bool,
        typer.Option(help="Let the solver choose operator variants (output-keeping BatchNorm; gradients within a "
                          "stated tolerance). --no-variants: none, bit-exact gradients (offloads stay: see --offload)."),
    ] = True,
    offload: Annotated[
        bool,
        typer.Option(help="Let the solver move a module call's saved tensors to host memory until backward needs "
                          "them (CUDA profiles only: they measure the copy speed). --no-offload: never."),
    ] = True,
    json_output: Annotated[bool, typer.Option("--json", help="Print a JSON summary on stdout.")] = False,
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
            profile=profile, budget=budget, output=output, time_limit=time_limit, gap=gap, workers=workers,
            seed=seed, json_output=json_output, variants=variants, offloads=offload,
        )
        if sweep:
            solve_cmd.run_sweep(args, sweep, plot)
        else:
            solve_cmd.run(args)


@app.command(
    help=(
        "Run a schedule on a real training step next to the unmodified model: measured vs predicted peak, "
        "step time, and with --check gradient, parameter and BatchNorm-buffer equality.\n\n"
        "Exits 7 when the measured peak is over the budget or gradients differ, 5 when the schedule does not "
        "match the model.\n\nExample:\n\n  monet apply schedules/resnet50-60pct.yaml --check\n\n" + EXIT_CODES_HELP
    ),
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
        Optional[Path], typer.Option(help="The schedule's profile, for the predicted timeline. Default: found in configs/.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
) -> None:
    from monet_cli.cli import apply_cmd

    with user_errors():
        apply_cmd.run(
            apply_cmd.ApplyArgs(schedule=schedule, steps=steps, check=check, device=device, json_output=json_output,
                                timeline=timeline, profile=profile)
        )


@app.command(help="Versions of monet, torch, torchvision, ortools and Python, and the device with its memory.")
def env(json_output: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False) -> None:
    from monet_cli.cli import info_cmds
    from monet_cli.cli.render import print_json, print_pairs

    with user_errors():
        report = info_cmds.as_dict(info_cmds.environment())
        if json_output:
            print_json(report)
        else:
            print_pairs("monet env", report)


@app.command(
    help=(
        "Check a schedule without training: schema, versions, internal consistency, and its fingerprint "
        "against the model it names (or --model). A schedule made on CUDA is checked on a machine without a GPU as "
        "far as fake CUDA tensors allow, and what could not be checked is listed. Exit 0 when it matches, 5 when "
        "it does not, 6 when the file is unsupported or corrupt.\n\nExample:\n\n  monet validate schedules/resnet50-60pct.yaml\n\n"
        + EXIT_CODES_HELP
    ),
    no_args_is_help=True,
)
def validate(
    schedule: Annotated[Path, typer.Argument(help="Schedule file.")],
    model: Annotated[
        Optional[str], typer.Option("--model", help="Run config, torchvision name or package.module:function.")
    ] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
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
                stderr.print(f"[{colours[check.status]}]{check.status:>11}[/] {check.name}: {check.detail}", highlight=False)
            if result.ok:
                unchecked = sum(c.status == "not checked" for c in result.checks)
                note = f" ({unchecked} not checked, listed above)" if unchecked else ""
                stderr.print(f"[green]ok[/green] {schedule} matches {result.model}{note}")
        info_cmds.raise_if_mismatch(result)


@app.command(
    help=(
        "Summarise a profile or a schedule: model, device, versions, budget, predicted peak and overhead, what each "
        "segment keeps or recomputes, and the top memory holders at the peak. --timeline out.html (or .png with "
        "matplotlib) draws live memory over the step with the budget line.\n\nExample:\n\n"
        "  monet inspect schedules/resnet50-60pct.yaml --timeline timeline.html\n\n" + EXIT_CODES_HELP
    ),
    no_args_is_help=True,
)
def inspect(
    file: Annotated[Path, typer.Argument(help="A profile or a schedule.")],
    profile: Annotated[
        Optional[Path], typer.Option(help="The schedule's profile. Default: the configs/*.profile.yaml it was solved from.")
    ] = None,
    timeline: Annotated[Optional[Path], typer.Option(help="Write a memory timeline (.html, .png, .svg).")] = None,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
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


@app.command(
    help=(
        "Without solving: parameters, gradients, optimizer state, activations kept for backward, the baseline "
        "peak and the smallest peak any schedule can reach. MODEL is profiled first (same options as "
        "monet profile); a PROFILE file is read as is. --fits SIZE exits 0 when it fits as it is, 0 with a note "
        "when it fits only with a schedule, 7 when it cannot fit; --fits auto uses the device's free memory.\n\n"
        "Example:\n\n  monet estimate resnet50 -b 32 -i 3,128,128 --fits 8G\n\n" + EXIT_CODES_HELP
    ),
    no_args_is_help=True,
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
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON on stdout.")] = False,
) -> None:
    from monet_cli.cli import estimate_cmd
    from monet_cli.cli.render import print_json, print_pairs, stderr

    with user_errors():
        if estimate_cmd.is_profile_file(target):
            from monet_cli.core.profile import load_profile

            profile = load_profile(Path(target))
        else:
            from monet_cli.cli import profile_cmd

            profile = profile_cmd.profile_only(profile_cmd.ProfileArgs(
                model=target, batch_size=batch_size, input_shapes=input_shape or [], input_dtypes=input_dtype or [],
                input_range=input_range, model_args=model_arg or [], device=device, optimizer=optimizer, lr=None,
                loss=None, steps=1, seed=None, output=None, json_output=json_output, precision=precision,
            ))
        result = estimate_cmd.estimate(profile, target, fits)
        if json_output:
            print_json(estimate_cmd.as_dict(result))
        else:
            print_pairs(f"monet estimate: {profile.model.name}", estimate_cmd.as_dict(result))
        line = estimate_cmd.verdict_line(result)
        if line and result.verdict != "does-not-fit":
            stderr.print(line)
        estimate_cmd.raise_if_not_fitting(result)


def main() -> None:
    app()
