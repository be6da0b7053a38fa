"""Operator variants: autograd functions that keep other tensors for backward than PyTorch's.

Two exist, chosen per site by the solver (``monet_cli/core/variants.py`` finds the sites).

``maxpool_offsets``: a max-pooling keeps, instead of its input and its int64 indices, each
maximum's offset from its window's first element (uint8, or int16 for wide rows), and
rebuilds the indices from them in backward for PyTorch's own backward kernel: bit-exact,
and 1/8 (or 1/4) of the indices' bytes. Its narrowing runs as machinery (the fingerprint
check and the timeline skip those ops; the memory meter counts them).

``bn_output``: where a
BatchNorm's output y feeds only an activation (ReLU, ReLU6, Hardtanh) whose output r feeds
only convolutions, PyTorch keeps the conv output before the BatchNorm (its input) and r
(saved by the activation and by every convolution). With the variant

- the BatchNorm keeps y instead of its input and rebuilds the input from y, its weight and
  bias and the batch statistics in backward (in-place activated BatchNorm's trick; not
  bit-exact, see ``TOLERANCE``; a layer with a weight near zero keeps its input instead);
- the activation keeps its input y instead of its output (the same gradient, bit for bit);
- each convolution keeps y and recomputes r from it in backward (bit for bit).

So one tensor is kept where PyTorch keeps two (ReLU) or three (ReLU6, which keeps its input).
The forward runs the same aten ops as the unmodified modules, so fingerprints still match.

``install_variants`` installs them on a model's modules; an activation or convolution takes
the variant path only for a tensor that came out of a variant BatchNorm, so a shared
activation module (torchvision's Bottleneck calls one ReLU three times) works unchanged
elsewhere.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from monet_cli.core.variants import MIN_BN_WEIGHT, VariantSite
from monet_cli.errors import FingerprintError
from monet_cli.runtime.meter import MachineryMarker

_FROM_VARIANT_BN = "_monet_variant_bn_output"
"""Attribute set on a variant BatchNorm's output: activations downstream may keep it."""
_RECOMPUTE_FROM = "_monet_recompute_from"
"""Attribute set on a variant activation's output: (its input, how to recompute it)."""


class _BatchNormKeepsOutput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean, running_var, momentum, eps):
        # The same kernel choice as F.batch_norm (native on CPU, cuDNN where it applies).
        out, save_mean, save_invstd, _, _ = torch.ops.aten._batch_norm_impl_index(
            x, weight, bias, running_mean, running_var, True, momentum, eps, torch.backends.cudnn.enabled
        )
        # The batch mean is not read in backward, but PyTorch's node keeps it too: the profile's
        # packs stay what this node keeps (a few bytes per channel).
        ctx.save_for_backward(out, weight, bias, save_mean, save_invstd)
        ctx.eps = eps
        return out

    @staticmethod
    def backward(ctx, grad):
        out, weight, bias, _mean, invstd = ctx.saved_tensors
        centred = _centred_input(out, weight, bias, invstd)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]]
        # PyTorch's backward reads the input only as (x - mean) * invstd: given the centred
        # input and a zero mean, its own kernel computes every gradient. Beside the rebuilt
        # input, this zero statistic is the one tensor the variant adds to PyTorch's backward
        # (``monet_cli/core/variants.py`` counts both).
        gx, gw, gb = torch.ops.aten.native_batch_norm_backward(
            grad.contiguous(), centred, weight, None, None, torch.zeros_like(invstd), invstd, True, ctx.eps, mask
        )
        return gx, gw, gb, None, None, None, None


def _centred_input(out: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, invstd: torch.Tensor) -> torch.Tensor:
    """x - mean = (y - b) / (w * invstd), in one pass over y. Its two per-channel factors die
    on return, before the backward kernel allocates the gradients."""
    shape = (1, -1) + (1,) * (out.dim() - 2)
    scale = (weight * invstd).reciprocal_()
    shift = (bias * scale).neg_()
    return torch.addcmul(shift.view(shape), out, scale.view(shape))


class _ActivationKeepsInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, low, high):
        ctx.save_for_backward(y)
        ctx.bounds = (low, high)
        return _activate(y, low, high)

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        low, high = ctx.bounds
        if high is None:
            return torch.ops.aten.threshold_backward(grad, y, 0), None, None
        return torch.ops.aten.hardtanh_backward(grad, y, low, high), None, None


class _ConvRecomputesInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, r, y, low, high, conv: nn.Module, weight, bias):
        ctx.save_for_backward(y, weight)
        ctx.bounds = (low, high)
        ctx.conv = (conv.stride, conv.padding, conv.dilation, conv.groups, None if bias is None else bias.shape)
        return conv._conv_forward(r, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        y, weight = ctx.saved_tensors
        stride, padding, dilation, groups, bias_sizes = ctx.conv
        r = _activate(y, *ctx.bounds)
        mask = [ctx.needs_input_grad[0], ctx.needs_input_grad[5], bias_sizes is not None and ctx.needs_input_grad[6]]
        zeros = [0] * len(stride)
        gr, gw, gb = torch.ops.aten.convolution_backward(
            grad, r, weight, bias_sizes, stride, padding, dilation, False, zeros, groups, mask
        )
        return gr, None, None, None, None, gw, gb


def _activate(y: torch.Tensor, low: float, high: float | None) -> torch.Tensor:
    return torch.relu(y) if high is None else F.hardtanh(y, low, high)


def _bounds(module: nn.Module) -> tuple[float, float | None]:
    if isinstance(module, nn.Hardtanh):  # ReLU6 is a Hardtanh
        return float(module.min_val), float(module.max_val)
    return 0.0, None


def bn_weight_too_small(module: nn.Module) -> bool:
    """A weight near zero makes the rebuilt input (y - b) / w meaningless. Checked outside any
    dispatch mode: these few ops on the weight are no part of the model's step (the
    fingerprint check and the memory meter see the step's ops only)."""
    from torch.utils._python_dispatch import _disable_current_modes

    with torch.no_grad(), _disable_current_modes():
        return bool(module.weight.abs().min() < MIN_BN_WEIGHT)


def _batchnorm_forward(module: nn.modules.batchnorm._BatchNorm, original):
    @functools.wraps(original)
    def forward(x: torch.Tensor) -> torch.Tensor:
        if not (
            module.training and torch.is_grad_enabled() and module.track_running_stats and module.affine
        ) or bn_weight_too_small(module):
            return original(x)
        module._check_input_dim(x)
        # nn.BatchNorm's own bookkeeping, in its order (the counter first, as its forward does).
        factor = 0.0 if module.momentum is None else module.momentum
        if module.num_batches_tracked is not None:
            module.num_batches_tracked.add_(1)
            factor = 1.0 / float(module.num_batches_tracked) if module.momentum is None else module.momentum
        out = _BatchNormKeepsOutput.apply(
            x, module.weight, module.bias, module.running_mean, module.running_var, factor, module.eps
        )
        setattr(out, _FROM_VARIANT_BN, True)
        return out

    return forward


def _activation_forward(module: nn.Module, original):
    low, high = _bounds(module)

    @functools.wraps(original)
    def forward(y: torch.Tensor) -> torch.Tensor:
        if not (getattr(y, _FROM_VARIANT_BN, False) and torch.is_grad_enabled()):
            return original(y)
        r = _ActivationKeepsInput.apply(y, low, high)
        setattr(r, _RECOMPUTE_FROM, (y, low, high))
        return r

    return forward


def _conv_forward(module: nn.Module, original):
    @functools.wraps(original)
    def forward(r: torch.Tensor) -> torch.Tensor:
        source = getattr(r, _RECOMPUTE_FROM, None)
        if source is None or not torch.is_grad_enabled():
            return original(r)
        y, low, high = source
        return _ConvRecomputesInput.apply(r, y, low, high, module, module.weight, module.bias)

    return forward


class _MaxPoolKeepsOffsets(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pool: nn.MaxPool2d, offset_dtype, machinery):
        geometry = _pool_geometry(pool)
        out, indices = torch.ops.aten.max_pool2d_with_indices(x, *geometry)
        with machinery:
            offsets = (indices - _window_origins(x.shape[-1], out.shape[-2:], geometry, x.device)).to(offset_dtype)
        ctx.save_for_backward(offsets)
        ctx.geometry, ctx.input_shape = geometry, x.shape
        return out

    @staticmethod
    def backward(ctx, grad):
        (offsets,) = ctx.saved_tensors
        shape = ctx.input_shape
        indices = offsets.to(torch.int64).add_(_window_origins(shape[-1], grad.shape[-2:], ctx.geometry, grad.device))
        # The kernel reads the input's shape only: a stand-in of it that allocates nothing (a
        # view of the gradient, which has the input's dtype, with every stride 0).
        like = grad.as_strided(shape, (0,) * len(shape))
        gx = torch.ops.aten.max_pool2d_with_indices_backward(grad, like, *ctx.geometry, indices)
        return gx, None, None, None


def _pool_geometry(pool: nn.MaxPool2d) -> tuple:
    """(kernel, stride, padding, dilation, ceil_mode) as max_pool2d_with_indices takes them."""
    pair = torch.nn.modules.utils._pair
    stride = pool.stride if pool.stride is not None else pool.kernel_size
    return pair(pool.kernel_size), pair(stride), pair(pool.padding), pair(pool.dilation), pool.ceil_mode


def _window_origins(width: int, out_hw: tuple[int, int], geometry: tuple, device: torch.device) -> torch.Tensor:
    """Flat index of each output's window corner in its input plane (may be below zero: padding)."""
    _, (sh, sw), (ph, pw), _, _ = geometry
    rows = torch.arange(out_hw[0], device=device).mul_(sh * width).sub_(ph * width + pw)
    return rows[:, None] + torch.arange(out_hw[1], device=device).mul_(sw)


def offset_dtype(pool: nn.MaxPool2d, width: int) -> torch.dtype | None:
    """The narrowest integer holding every offset inside a window of rows ``width`` wide."""
    (kh, kw), _, _, (dh, dw), _ = _pool_geometry(pool)
    largest = (kh - 1) * dh * width + (kw - 1) * dw
    return torch.uint8 if largest < 2**8 else torch.int16 if largest < 2**15 else None


def _maxpool_forward(module: nn.MaxPool2d, original, machinery: MachineryMarker):
    @functools.wraps(original)
    def forward(x: torch.Tensor) -> torch.Tensor:
        dtype = offset_dtype(module, x.shape[-1])
        if dtype is None or module.return_indices or x.dim() != 4 or not torch.is_grad_enabled():
            return original(x)
        return _MaxPoolKeepsOffsets.apply(x, module, dtype, machinery)

    return forward


_WRAPPERS = {
    "bn": _batchnorm_forward,
    "activation": _activation_forward,
    "conv": _conv_forward,
    "maxpool": _maxpool_forward,
}


def install_variants(model: nn.Module, sites: Iterable[VariantSite], machinery: MachineryMarker | None = None) -> None:
    """Install each site's variant on the modules it runs in. ``machinery`` is the executor's
    flag for ops that are not the model's own (a variant's bookkeeping)."""
    modules = dict(model.named_modules())
    for site in sites:
        for role, path in site.roles():
            module = modules.get(path)
            if module is None:
                raise FingerprintError(
                    f"schedule variant at '{site.module}' names '{path}', which is not a "
                    "module of this model (the schedule was made for another model)"
                )
            problem = _module_problem(role, module)
            if problem:
                raise FingerprintError(f"schedule variant at '{site.module}': '{path}' {problem}")
            install_on(role, module, machinery)


def install_on(role: str, module: nn.Module, machinery: MachineryMarker | None = None) -> None:
    """Make ``module`` run its part (``bn``, ``activation``, ``conv``, ``maxpool``) of a variant."""
    if getattr(module, "_monet_variant", None) is not None:
        return
    wrap = _WRAPPERS[role]
    if role == "maxpool":
        # Where no executor watches (a measurement), a marker of its own: nobody reads it.
        module.forward = wrap(module, module.forward, machinery or MachineryMarker())
    else:
        module.forward = wrap(module, module.forward)
    module._monet_variant = role


# Exact classes only: a subclass may do more in its forward than the variant replaces (timm's
# BatchNormAct2d applies its activation, Conv2dSame pads, SyncBatchNorm reduces across ranks).
_CLASSES = {
    "bn": ((nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d), "a BatchNorm1d/2d/3d with weight and bias"),
    "activation": ((nn.ReLU, nn.ReLU6, nn.Hardtanh), "a ReLU, ReLU6 or Hardtanh"),
    "conv": ((nn.Conv1d, nn.Conv2d, nn.Conv3d), "a Conv1d/2d/3d with numeric zero padding"),
    "maxpool": ((nn.MaxPool2d,), "a MaxPool2d returning its output alone"),
}


def _module_problem(role: str, module: nn.Module) -> str:
    """Why ``module`` cannot take ``role`` in a variant ("" when it can)."""
    classes, what = _CLASSES[role]
    fits = type(module) in classes
    if role == "bn":
        fits = fits and module.affine
    elif role == "conv":
        fits = fits and module.padding_mode == "zeros" and not isinstance(module.padding, str)
    elif role == "maxpool":
        fits = fits and not module.return_indices
    return "" if fits else f"is not {what} ({type(module).__name__})"


def variant_ready(model: nn.Module, site: VariantSite) -> str:
    """Why ``site`` cannot run its variant on ``model`` as it is now ("" when it can)."""
    modules = dict(model.named_modules())
    for role, path in site.roles():
        module = modules.get(path)
        if module is None:
            return f"'{path}' is not a module of this model"
        problem = _module_problem(role, module)
        if problem:
            return f"'{path}' {problem}"
    if site.impl == "bn_output" and bn_weight_too_small(modules[site.module]):
        return f"'{site.module}' has a weight below {MIN_BN_WEIGHT} in magnitude"
    return ""
