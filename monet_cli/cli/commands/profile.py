"""``monet profile``."""

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
)

HELP = (
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
)


def profile(
    model: Annotated[
        str, typer.Argument(help="Run config, hf:NAME, timm:NAME, torchvision name or package.module:function.")
    ],
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
    steps: Annotated[
        int,
        typer.Option(
            help="Timed steps after one warm-up (short steps: up to 5 times as many, as fit in 3 s); "
            "times are their median."
        ),
    ] = 3,
    seed: Annotated[Optional[int], typer.Option(help="Seed for weights and random inputs.")] = None,
    output: Annotated[
        Optional[Path], typer.Option("--output", "-o", help="Profile file. Default: configs/NAME.profile.yaml.")
    ] = None,
    json_output: JsonOutput = False,
) -> None:
    from monet_cli.cli import profile_cmd

    with user_errors():
        profile_cmd.run(
            profile_cmd.ProfileArgs(
                model=model,
                batch_size=batch_size,
                input_shapes=input_shape or [],
                input_dtypes=input_dtype or [],
                input_range=input_range,
                model_args=model_arg or [],
                device=device,
                optimizer=optimizer,
                lr=lr,
                loss=loss,
                steps=steps,
                seed=seed,
                output=output,
                json_output=json_output,
                precision=precision,
            )
        )
