"""The training step monet profiles and schedules.

One step is ``zero_grad(set_to_none=True)``, forward, loss, backward, optimizer step.
Inputs and labels are random but seeded, so every rebuild feeds the same data.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from monet_cli.core.profile import LOSS_MODULE, PRECISIONS, InputSpec, ModelSpec
from monet_cli.errors import DeviceError, ModelError, MonetError, UsageError
from monet_cli.workload.resolve import build_model

# Activation modules whose in-place mode stops a schedule from keeping their output.
_ACTIVATIONS_WITH_INPLACE = (
    nn.ReLU,
    nn.ReLU6,
    nn.Hardtanh,
    nn.LeakyReLU,
    nn.SiLU,
    nn.Hardswish,
    nn.Hardsigmoid,
    nn.ELU,
    nn.CELU,
    nn.SELU,
    nn.Mish,
    nn.RReLU,
    nn.Threshold,
)

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "long": torch.int64,
    "int32": torch.int32,
}


def resolve_device(text: str) -> torch.device:
    """``auto`` picks CUDA when present; asking for CUDA without a GPU is an error."""
    if text == "auto":
        text = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(text)
    except RuntimeError:
        raise UsageError(f"--device '{text}': expected auto, cpu, cuda or cuda:N") from None
    if device.type not in ("cpu", "cuda"):
        raise UsageError(f"--device '{text}': only cpu and cuda are supported")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceError(f"--device {text}: no CUDA GPU is available on this machine (use --device cpu)")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise DeviceError(f"--device {text}: only {torch.cuda.device_count()} CUDA device(s) present")
        if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING", "0") != "0":
            # PyTorch then calls cudaMalloc directly and its memory statistics count nothing.
            raise UsageError(
                "PYTORCH_NO_CUDA_MEMORY_CACHING is set: PyTorch's allocator then counts no memory, so no "
                "CUDA step can be measured (unset it, or set it to 0)"
            )
    return device


def parse_dtype(name: str) -> torch.dtype:
    if name not in _DTYPES:
        raise UsageError(f"input dtype '{name}': expected one of {', '.join(sorted(_DTYPES))}")
    return _DTYPES[name]


def make_out_of_place(model: nn.Module) -> tuple[nn.Module, ...]:
    """Switch in-place activation modules to out-of-place; returns those it changed.

    Autograd keeps a ReLU's output; when the ReLU runs in place that output is the
    BatchNorm's output mutated, which selective checkpointing refuses to keep. The
    out-of-place version costs no memory when the next op saves the output anyway.
    """
    changed = in_place_activations(model)
    for module in changed:
        module.inplace = False
    return changed


def in_place_activations(model: nn.Module) -> tuple[nn.Module, ...]:
    """The activation modules of ``model`` that run in place."""
    return tuple(
        module
        for module in model.modules()
        if isinstance(module, _ACTIVATIONS_WITH_INPLACE) and getattr(module, "inplace", False)
    )


def turn_off_kv_cache(model: nn.Module) -> bool:
    """Train without a key/value cache (Hugging Face ``config.use_cache``); True if it was on.

    A cache filled during the forward would be filled again by every recompute, so
    transformers' own gradient checkpointing turns it off too. Training never reads it.
    """
    config = getattr(model, "config", None)
    if getattr(config, "use_cache", False) is True:
        config.use_cache = False
        return True
    return False


def make_inputs(
    specs: tuple[InputSpec, ...], batch_size: int, device: torch.device, seed: int
) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed + 1)
    tensors = []
    for spec in specs:
        dtype = parse_dtype(spec.dtype)
        shape = (batch_size, *spec.shape)
        if dtype.is_floating_point:
            tensor = torch.randn(shape, generator=generator).to(dtype)
        else:
            low = 0 if spec.low is None else spec.low
            high = 2 if spec.high is None else spec.high
            tensor = torch.randint(low, high, shape, generator=generator, dtype=dtype)
        tensors.append(tensor.to(device))
    return tuple(tensors)


def make_optimizer(model: nn.Module, spec: ModelSpec) -> torch.optim.Optimizer | None:
    opt = spec.optimizer
    params = [p for p in model.parameters() if p.requires_grad]
    if opt.name == "none" or not params:
        return None
    if opt.name == "sgd":
        return torch.optim.SGD(params, lr=opt.lr, momentum=opt.momentum, weight_decay=opt.weight_decay)
    if opt.name == "adamw":
        return torch.optim.AdamW(params, lr=opt.lr, weight_decay=opt.weight_decay)
    raise UsageError(f"--optimizer '{opt.name}': expected sgd, adamw or none")


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise UsageError(f"--precision '{precision}': expected one of {', '.join(PRECISIONS)}")
    return precision


def precision_context(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """Forward and loss run under autocast (as Lightning does); backward and the optimizer outside it."""
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=dtype)


def model_loss(output: Any) -> torch.Tensor | None:
    """The loss a model computed itself (Hugging Face outputs carry ``.loss`` when given labels)."""
    loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
    return loss if isinstance(loss, torch.Tensor) and loss.numel() == 1 else None


def first_tensor(output: Any) -> torch.Tensor:
    """The tensor a default loss is computed on (models may return tuples, dicts or ``ModelOutput``s)."""
    if isinstance(output, torch.Tensor):
        return output
    logits = output.get("logits") if isinstance(output, dict) else getattr(output, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        for item in output:
            if isinstance(item, torch.Tensor):
                return item
    raise ModelError(f"the model returned {type(output).__name__}; the default loss needs a tensor output")


@dataclass
class LossFunction:
    """Named loss with lazily drawn, then fixed, random labels."""

    name: str
    seed: int
    _target: torch.Tensor | None = field(default=None, repr=False)
    _custom: Callable[[Any], torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if ":" in self.name:
            module_name, _, attr = self.name.partition(":")
            try:
                self._custom = getattr(importlib.import_module(module_name), attr)
            except (ImportError, AttributeError) as err:
                raise UsageError(f"loss '{self.name}': cannot import: {err}") from None
        elif self.name not in ("auto", "cross_entropy", "token_cross_entropy", "mean_square"):
            raise UsageError(
                f"loss '{self.name}': expected auto, cross_entropy, token_cross_entropy, "
                "mean_square or package.module:function"
            )

    def __call__(self, output: Any) -> torch.Tensor:
        if self._custom is not None:
            return self._custom(output)
        kind = self.name
        if kind == "auto" and (own := model_loss(output)) is not None:
            return own
        out = first_tensor(output)
        if kind == "auto":
            kind = "cross_entropy" if out.dim() == 2 and out.is_floating_point() else "mean_square"
        if kind == "mean_square":
            return out.float().pow(2).mean()
        if kind == "cross_entropy":
            return F.cross_entropy(out, self.target(out.shape[:1], out.shape[1], out.device))
        if out.dim() != 3:
            raise ModelError(f"token_cross_entropy needs [N, T, vocab] logits, got shape {tuple(out.shape)}")
        logits = out.reshape(-1, out.shape[-1])
        return F.cross_entropy(logits, self.target(logits.shape[:1], out.shape[-1], out.device))

    def target(self, shape: torch.Size, classes: int, device: torch.device) -> torch.Tensor:
        if self._target is None or self._target.shape != shape:
            generator = torch.Generator().manual_seed(self.seed + 2)
            self._target = torch.randint(0, classes, tuple(shape), generator=generator).to(device)
        return self._target

    def tensors(self) -> list[torch.Tensor]:
        return [] if self._target is None else [self._target]


@dataclass
class Workload:
    """A model with its data, loss and optimizer: everything one step needs."""

    spec: ModelSpec
    model: nn.Module
    inputs: tuple[torch.Tensor, ...]
    loss_fn: LossFunction
    optimizer: torch.optim.Optimizer | None
    device: torch.device
    module_names: dict[int, str] = field(default_factory=dict)
    scaler: torch.amp.GradScaler | None = None
    """fp16-mixed: scales the loss so small float16 gradients do not underflow."""
    out_of_place: tuple[nn.Module, ...] = ()
    """Activation modules the factory built in place and ``build_workload`` switched out of place."""
    output: Any = field(default=None, repr=False)
    """The last training forward's output, held as ``outputs = model(batch)`` in a training loop
    holds it: through the loss, backward and the optimizer step, and into the next step until
    its forward returns. A model's output can be its largest tensor (a language model's logits)."""

    def call_args(self) -> tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
        """The model's positional and keyword inputs (``input_ids=...``, ``labels=...``)."""
        args = tuple(t for t, s in zip(self.inputs, self.spec.inputs) if s.name is None)
        kwargs = {s.name: t for t, s in zip(self.inputs, self.spec.inputs) if s.name is not None}
        return args, kwargs

    def autocast(self) -> contextlib.AbstractContextManager:
        return precision_context(self.spec.precision, self.device)

    def run_model(self, model: nn.Module | None = None) -> Any:
        """One forward of ``model`` (default: this workload's) on the inputs, under the precision's autocast."""
        args, kwargs = self.call_args()
        with self.autocast():
            return (self.model if model is None else model)(*args, **kwargs)

    def observe_forward(self) -> None:
        """One eval-mode forward without grad, for hooks that look at what modules are given
        (it changes no BatchNorm statistics)."""
        was_training = self.model.training
        self.model.eval()
        try:
            with torch.no_grad():
                self.run_model()
        finally:
            self.model.train(was_training)

    def forward_loss(self) -> torch.Tensor:
        args, kwargs = self.call_args()
        with self.autocast():
            self.output = self.model(*args, **kwargs)  # the previous step's output dies here
            with loss_scope():
                return self.loss_fn(self.output)

    def zero_grad(self) -> None:
        if self.optimizer is not None:
            self.optimizer.zero_grad(set_to_none=True)
        else:
            self.model.zero_grad(set_to_none=True)

    def step(self, on_phase: Callable[[str, torch.Tensor], None] | None = None) -> float:
        """Forward, loss, backward, optimizer step (grads must already be cleared).

        ``on_phase(name, loss)`` is called as backward and the optimizer step begin.
        """
        loss = self.forward_loss()
        if on_phase:
            on_phase("backward", loss)
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()
        if on_phase:
            on_phase("optimizer", loss)
        if self.optimizer is not None:
            if self.scaler is None:
                self.optimizer.step()
            else:
                self.scaler.step(self.optimizer)
                self.scaler.update()
        return float(loss.detach())

    def timed_step(self, seed: int | None = None, on_phase: Callable[[str, torch.Tensor], None] | None = None) -> float:
        """One plain step including ``zero_grad``; returns its wall time in ms (``on_phase`` as
        in ``step``)."""
        if seed is not None:
            torch.manual_seed(seed)
        self.sync()
        start = time.perf_counter()
        self.zero_grad()
        self.step(on_phase)
        self.sync()
        return (time.perf_counter() - start) * 1000.0

    def resident_tensors(self) -> Iterator[tuple[torch.Tensor, str]]:
        """Every tensor this workload keeps between steps (parameters, gradients, buffers,
        optimizer state, data, the last output), with its kind of memory. A generator: whoever
        counts them must not hold the output, which the next forward frees
        (``LiveStorageMeter.track_resident``)."""
        yield from ((p, "param") for p in self.model.parameters())
        yield from ((p.grad, "grad") for p in self.model.parameters() if p.grad is not None)
        yield from ((b, "buffer") for b in self.model.buffers())
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                yield from ((v, "optimizer") for v in state.values() if isinstance(v, torch.Tensor))
        yield from ((t, "input") for t in self.data_tensors())
        yield from ((t, "output") for t in tree_flatten(self.output)[0] if isinstance(t, torch.Tensor))

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def data_tensors(self) -> list[torch.Tensor]:
        return [*self.inputs, *self.loss_fn.tensors()]


class loss_scope:
    """Marks ops run while computing the loss (outside the model) for the recorder."""

    active = False

    def __enter__(self) -> None:
        loss_scope.active = True

    def __exit__(self, *exc: object) -> None:
        loss_scope.active = False


CUBLAS_DETERMINISTIC = ":4096:8"
"""cuBLAS workspace setting that deterministic algorithms need (and Hopper's default size)."""


def configure_cuda(device: torch.device) -> None:
    """Before any CUDA work: give cuBLAS the workspace setting deterministic algorithms need,
    unless the user chose one. ``monet profile`` and ``monet apply`` both do it, so their
    cuBLAS workspaces (which the allocator counts) are the same size."""
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_DETERMINISTIC)


def build_workload(spec: ModelSpec, device: torch.device, *, prepare: bool = True) -> Workload:
    """The model, data, loss and optimizer of ``spec``, prepared as monet profiles and
    applies (no KV cache, activations out of place); ``prepare=False`` leaves the model
    exactly as its factory built it (the unmodified baseline ``apply`` compares with)."""
    model = build_model(spec)
    out_of_place: tuple[nn.Module, ...] = ()
    if prepare:
        turn_off_kv_cache(model)
        if spec.out_of_place_activations:
            out_of_place = make_out_of_place(model)
    model.to(device).train()
    inputs = make_inputs(spec.inputs, spec.batch_size, device, spec.seed)
    optimizer = make_optimizer(model, spec)
    fp16 = check_precision(spec.precision) == "fp16-mixed" and optimizer is not None
    return Workload(
        spec=spec,
        model=model,
        inputs=inputs,
        loss_fn=LossFunction(spec.loss, spec.seed),
        optimizer=optimizer,
        device=device,
        module_names={id(m): name for name, m in model.named_modules()},
        scaler=torch.amp.GradScaler(device.type) if fp16 else None,
        out_of_place=out_of_place,
    )


def run_checked(action: Callable[[], Any], what: str) -> Any:
    """Run user-model code; its exceptions become one-line ``ModelError``s."""
    try:
        return action()
    except MonetError:
        raise
    except torch.cuda.OutOfMemoryError as err:
        raise ModelError(f"{what}: out of GPU memory: {str(err).splitlines()[0]}") from None
    except Exception as err:
        lines = str(err).strip().splitlines()
        raise ModelError(f"{what}: the model raised {type(err).__name__}: {lines[0] if lines else ''}") from None


__all__ = ["LOSS_MODULE", "Workload", "build_workload", "resolve_device", "run_checked"]
