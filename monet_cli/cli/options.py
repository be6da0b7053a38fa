"""Option declarations more than one command shares, each spelled once."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from monet_cli.errors import EXIT_CODE_TABLE

EXIT_CODES_HELP = "Exit codes: " + "; ".join(f"{code} {text}" for code, text in EXIT_CODE_TABLE) + "."

JsonOutput = Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")]
Workers = Annotated[Optional[int], typer.Option(help="CP-SAT workers. Default: CPU cores (max 8); 1 when CI is set.")]

# The options that build a training step (profile, estimate).
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
    typer.Option(
        help="32, bf16-mixed or fp16-mixed (forward and loss under torch.autocast; fp16 with a GradScaler). "
        "Default: 32."
    ),
]
ModelArg = Annotated[
    Optional[list[str]],
    typer.Option("--model-arg", help="KEY=VALUE passed to the model factory (hf: models: a config field); repeatable."),
]
