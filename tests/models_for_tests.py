"""Small user models for tests, loaded through import paths like ``tests.models_for_tests:skip_cnn``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class SkipCNN(nn.Module):
    """Conv-BN-ReLU twice, a concatenation skip and a linear head: input [N, 3, H, W]."""

    def __init__(self, num_classes: int = 5) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.body = nn.Sequential(nn.Conv2d(8, 8, 3, padding=1, bias=False), nn.BatchNorm2d(8), nn.ReLU(inplace=True))
        self.head = nn.Linear(16, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.stem(x)
        b = self.body(a)
        pooled = torch.cat([a, b], dim=1).mean(dim=(2, 3))
        return self.head(pooled)


def skip_cnn(num_classes: int = 5) -> nn.Module:
    return SkipCNN(num_classes)


class _Wide(nn.Module):
    """A residual branch with a 4x wider hidden layer: most of a block's saved bytes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up = nn.Parameter(torch.randn(4 * width, width) / width**0.5)
        self.down = nn.Parameter(torch.randn(width, 4 * width) / (4 * width) ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(torch.tanh(torch.nn.functional.linear(x, self.up)), self.down)


class _TwoBranchBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.first = _Wide(width)
        self.second = _Wide(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Pre-norm as in transformer layers: the block's own ops make each branch's input.
        x = x + self.first(torch.nn.functional.layer_norm(x, x.shape[-1:]))
        return x + self.second(torch.nn.functional.layer_norm(x, x.shape[-1:]))


def two_branch_mlp(width: int = 16, depth: int = 2, num_classes: int = 5) -> nn.Module:
    """Blocks of two wide residual branches, like a transformer layer's attention and MLP:
    the first branch nested inside its checkpointed block lowers the smallest peak."""
    return nn.Sequential(*(_TwoBranchBlock(width) for _ in range(depth)), nn.Linear(width, num_classes))


def not_a_module() -> str:
    return "not a model"


class _Broken(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise ValueError("expected 4 channels, got 3")


def broken_model() -> nn.Module:
    return _Broken()


def hf_gpt2(n_embd: int = 256, n_layer: int = 4) -> nn.Module:
    """The real-models issue's GPT-2 reproduction: a plain transformers model (KV cache on by default)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(vocab_size=1000, n_positions=128, n_embd=n_embd, n_layer=n_layer, n_head=4))


def hf_llama(hidden_size: int = 256, num_hidden_layers: int = 4) -> nn.Module:
    """The real-models issue's LLaMA reproduction (it crashed in backward: SAC's slice not found in storage)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(
        LlamaConfig(
            vocab_size=1000,
            hidden_size=hidden_size,
            intermediate_size=688 * hidden_size // 256,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=128,
        )
    )


class _CacheBlock(nn.Module):
    """Appends its keys to a cache shared by the model and reads all of it, like a KV cache."""

    def __init__(self, cache: list) -> None:
        super().__init__()
        self.cache = cache
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.append(self.proj(x))
        keys = torch.cat(self.cache, dim=1)  # a recompute in backward sees every block's entry
        return x + torch.tanh(keys).mean(dim=1, keepdim=True)


class CachingNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.cache: list = []
        self.stem = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh())
        self.blocks = nn.ModuleList(_CacheBlock(self.cache) for _ in range(2))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cache.clear()  # a fresh cache every forward, as transformers makes one per call
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x).mean(dim=1)


def caching_net() -> nn.Module:
    """Input [N, T, 16]. Its blocks cannot be recomputed: a re-run reads a grown cache."""
    return CachingNet()


class _Counting(nn.Module):
    """Scales by how often it ran: a re-run gives other values with the same ops."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0
        self.proj = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return torch.tanh(self.proj(x)) * self.calls


def counting_net() -> nn.Module:
    """Input [N, 16]."""
    return nn.Sequential(nn.Linear(16, 16), _Counting(), nn.Linear(16, 4))


class _FirstForwardsOnly(nn.Module):
    """Calls ``self.tap`` (no ops) in its first three forwards only: the same ops every step,
    other module calls from the fourth forward on."""

    def __init__(self) -> None:
        super().__init__()
        self.forwards = 0
        self.tap = nn.Identity()
        self.proj = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        if self.forwards <= 3:
            x = self.tap(x)
        return self.proj(x)


def changing_calls_net() -> nn.Module:
    """Input [N, 16]."""
    return _FirstForwardsOnly()


class _SharedLinear(nn.Module):
    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return torch.tanh(torch.nn.functional.linear(x, weight))


class SharedWeightNet(nn.Module):
    """One weight used by two modules. Under autocast the second use finds the cast in
    autocast's cache; its recompute in backward (a fresh autocast) casts again."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(16, 16) / 4)
        self.first = _SharedLinear()
        self.second = _SharedLinear()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.second(self.first(x, self.weight), self.weight))


def shared_weight_net() -> nn.Module:
    """Input [N, 16]."""
    return SharedWeightNet()


class _Shift(nn.Module):
    """Saves no input for backward (an add, then tanh which keeps its output)."""

    def __init__(self) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x + self.bias)


class InPlaceAfterNet(nn.Module):
    """``first``'s output is written in place after it returns (ResNet's ``out += identity``):
    fine to recompute. ``second``'s input is written after it ran: checkpointed, its backward
    fails ("modified by an inplace operation"), as checkpoint keeps the input it will re-run from."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(16, 16)
        self.second = _Shift()
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.first(x)
        out += x
        hidden = out * 3
        y = self.second(hidden)
        hidden.mul_(2)
        return self.head(y + hidden)


def in_place_after_net() -> nn.Module:
    """Input [N, 16]."""
    return InPlaceAfterNet()


class _Scatter(nn.Module):
    """Writes every other feature through ``put``, an op with no deterministic kernel."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc(x))
        index = torch.arange(0, h.numel(), 2, device=h.device)
        return h + torch.zeros_like(h).put(index, h.take(index))


def put_mlp(width: int = 16, num_classes: int = 5) -> nn.Module:
    return nn.Sequential(nn.Linear(width, width), _Scatter(width), _Scatter(width), nn.Linear(width, num_classes))


def bn_chain_net(width: int = 8, num_classes: int = 5) -> nn.Module:
    """Conv-BN-ReLU and Conv-BN-ReLU6 feeding convolutions (two variant sites), then a head
    whose BatchNorm feeds a pooling instead (no site): input [N, 3, H, W]."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.Conv2d(width, width, 3, padding=1),
        nn.BatchNorm2d(width),
        nn.ReLU6(inplace=True),
        nn.Conv2d(width, width, 1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )


def pool_net(width: int = 8, num_classes: int = 5) -> nn.Module:
    """ResNet's stem: Conv-BN-ReLU, a 3x3 stride-2 max-pooling (a variant site), then a conv
    and a linear head: input [N, 3, H, W]."""
    return nn.Sequential(
        nn.Conv2d(3, width, 3, padding=1, bias=False),
        nn.BatchNorm2d(width),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(3, stride=2, padding=1),
        nn.Conv2d(width, width, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(width, num_classes),
    )


class HandoffNet(nn.Module):
    """Linear, ReLU, Linear, Dropout called one after another, a residual reading the first
    Linear's output, and a head. Only ``act..drop`` passes one tensor along with nothing else
    reading it: one sibling chain. ``reroute=True`` feeds ``down`` the first Linear's output
    instead of the ReLU's (same ops and shapes, another hand-off)."""

    def __init__(self, width: int = 16, num_classes: int = 5, reroute: bool = False) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.down = nn.Linear(width, width)
        self.drop = nn.Dropout(0.25)
        self.head = nn.Linear(width, num_classes)
        self.reroute = reroute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        a = self.act(h)
        y = self.drop(self.down(h if self.reroute else a))
        return self.head(y + h)


def handoff_net(width: int = 16, num_classes: int = 5, reroute: bool = False) -> nn.Module:
    return HandoffNet(width, num_classes, reroute)


class StemNet(nn.Module):
    """A ResNet-like stem (conv, BatchNorm, ReLU, max-pooling called one after another in the
    root's forward) at full resolution, then a 4x wider block whose backward runs while the
    stem's saved tensors wait for theirs, and a head. Input [N, 3, H, W]."""

    def __init__(self, width: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.pool = nn.MaxPool2d(3, stride=2, padding=1)
        self.block = nn.Sequential(
            nn.Conv2d(width, 4 * width, 3, padding=1),
            nn.ReLU(),
            nn.Conv2d(4 * width, width, 3, padding=1),
            nn.ReLU(),
        )
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.bn(self.conv(x))))
        return self.head(self.block(x).mean(dim=(2, 3)))


def stem_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    return StemNet(width, num_classes)


class RangeNet(nn.Module):
    """A forward whose own code sits between its calls, which only op ranges can cover: a
    buffer it writes, dropout and a gated activation, an in-place add on a tensor it made,
    one module called twice, and a residual from its input. ``extra`` adds one own op (the
    same modules, another op sequence); ``island`` a float32 matmul with autocast switched off
    (as transformers' rotary embeddings and RMSNorm do); ``numpy`` a scale read through a numpy
    array. Input [N, width]."""

    def __init__(
        self, width: int = 16, num_classes: int = 5, extra: bool = False, island: bool = False, numpy: bool = False
    ) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.ReLU()
        self.bn = nn.BatchNorm1d(4 * width)
        self.down = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, num_classes)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))
        self.extra = extra
        self.mix = nn.Parameter(torch.eye(4 * width) + 0.01) if island else None
        self.numpy = numpy

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = self.act(self.up(x))
        h = torch.nn.functional.dropout(h * torch.sigmoid(h), 0.2, self.training)
        h = self.act(self.bn(h))
        g = h * 2.0
        g.add_(1.0)
        if self.extra:
            g = g * 0.5
        if self.numpy:  # a scale read through a numpy array
            g = g / float(g.detach().amax().numpy())
        if self.mix is not None:
            with torch.autocast(x.device.type, enabled=False):
                g = g.float() @ self.mix
        return self.head(x + self.down(g))


def range_net(
    width: int = 16, num_classes: int = 5, extra: bool = False, island: bool = False, numpy: bool = False
) -> nn.Module:
    return RangeNet(width, num_classes, extra, island, numpy)


class KeeperNet(nn.Module):
    """Own code that keeps a tensor on the module (``self.last``) and reads it once. Input [N, width]."""

    def __init__(self, width: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.last = torch.relu(self.up(x))
        return self.head(x + self.down(self.last * 2.0))


def keeper_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    return KeeperNet(width, num_classes)


class NormAttentionNet(nn.Module):
    """A LayerNorm, then attention called with its output three times and a keyword (as
    torchvision's ViT calls it), returning a tuple; then a Linear, a GELU and a Linear, each
    called with the one before's output alone. Only ``fc..out`` is a chain: the norm does not
    hand its output to the attention alone, nor the attention a tensor to ``fc``."""

    def __init__(self, width: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.fc = nn.Linear(width, width)
        self.act = nn.GELU()
        self.out = nn.Linear(width, width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        y, _ = self.attn(y, y, y, need_weights=False)
        return self.head(self.out(self.act(self.fc(y))).mean(1))


def norm_attention_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    return NormAttentionNet(width, num_classes)


class _AttentionBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, 2, batch_first=True)
        self.fc = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        y, _ = self.attn(y, y, y, need_weights=False)
        return x + self.fc(y)


def attention_block_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    """Two blocks of a LayerNorm, self-attention (query, key and value one tensor, as in
    torchvision's ViT) and a Linear, then a head over the mean token."""
    return nn.Sequential(_AttentionBlock(width), _AttentionBlock(width), _MeanTokens(), nn.Linear(width, num_classes))


class _MeanTokens(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(1)


class _Rotate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., 1::2], x[..., ::2]), dim=-1)


_ROTATE = _Rotate()
"""A module object no model registers, called from inside blocks' forwards: transformers'
LLaMA calls its rotary embedding through one like it."""


class _OutsideCallBlock(nn.Module):
    """Own ops around two Linears; ``outside=True`` calls ``_ROTATE`` twice among them (so
    the module outside the tree is called several times, as LLaMA's is once per layer) and
    runs one own op more."""

    def __init__(self, width: int, outside: bool) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.outside = outside

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x)) * 2.0 + 1.0
        h = _ROTATE(h) if self.outside else h * 0.5
        h = torch.sigmoid(h) * h - 0.5
        if self.outside:
            h = _ROTATE(h)
        h = torch.tanh(h) * 3.0 + 0.25
        if self.outside:
            h = h * 1.5 + 0.5
        return x + self.b(h)


def outside_call_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    """A block calling a module outside the model's tree, then one that does not."""
    return nn.Sequential(
        _OutsideCallBlock(width, outside=True), _OutsideCallBlock(width, outside=False), nn.Linear(width, num_classes)
    )


class IndexingNet(nn.Module):
    """Own code that indexes with tuples of slices, None and an Ellipsis, as attention code
    does, between two Linears. Input [N, width]."""

    def __init__(self, width: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(x)
        half = h.shape[-1] // 2
        g = h[..., :half] * h[:, None, half:].squeeze(1)
        return self.head(x + self.mid(torch.tanh(g)))


def indexing_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    return IndexingNet(width, num_classes)


class _Square(torch.autograd.Function):
    """x * x with its own backward, saving its input alone (autograd's mul saves it twice)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad


class _SquareBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(_Square.apply(self.a(x))))


class FunctionNet(nn.Module):
    """A custom autograd Function in the model's own code, between two Linears, and in a block's
    forward. Input [N, width]."""

    def __init__(self, width: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.block = _SquareBlock(width)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Square.apply(torch.tanh(self.up(x)) * 2.0) + 1.0
        return self.head(self.block(torch.sigmoid(h) * h))


def function_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    return FunctionNet(width, num_classes)


class GeneratorNet(nn.Module):
    """Own code that masks with random numbers from the model's own generator (augmentation and
    diffusion code pass one), between two Linears. Input [N, width]."""

    def __init__(self, width: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.up = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)
        self.head = nn.Linear(width, num_classes)
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.up(x)) * 2.0
        keep = torch.rand(h.shape, generator=self.generator) > 0.25
        return self.head(x + self.mid(torch.sigmoid(h) * keep))


def generator_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    return GeneratorNet(width, num_classes)


class _HookedBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, 4 * width)
        self.b = nn.Linear(4 * width, 4 * width)
        self.c = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.c(F.gelu(self.b(torch.tanh(self.a(x)))))


class HiddenStatesNet(nn.Module):
    """Three residual blocks, each called with the one before's output alone (a chain), then a
    head. Asked as transformers' models are (``output_hidden_states=True``), the forward also
    returns every block's output. Input [N, width]."""

    def __init__(self, width: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_HookedBlock(width) for _ in range(3))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor, output_hidden_states: bool = False) -> Any:
        hidden = []
        for block in self.blocks:
            x = block(x)
            hidden.append(x)
        logits = self.head(x)
        return (logits, tuple(hidden)) if output_hidden_states else logits


def hidden_states_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    return HiddenStatesNet(width, num_classes)


class HookedNet(nn.Module):
    """Feature matching, as distillation and perceptual losses do it: a forward hook on each
    block's first Linear collects its output, and the forward adds a penalty on them.
    ``store=False``: the hooks only note the outputs' shapes; ``None``: no hooks (a training
    loop may register its own). Input [N, width]."""

    def __init__(self, width: int = 16, num_classes: int = 5, store: bool | None = True) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_HookedBlock(width) for _ in range(3))
        self.head = nn.Linear(width, num_classes)
        self.features: list[torch.Tensor] = []
        self.shapes: list[torch.Size] = []
        for block in self.blocks if store is not None else ():
            block.a.register_forward_hook(self._collect if store else self._note)

    def _collect(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.features.append(output)

    def _note(self, module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        self.shapes.append(output.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.features.clear()
        self.shapes.clear()
        for block in self.blocks:
            x = block(x)
        penalty = sum((f.pow(2).mean() for f in self.features), torch.zeros((), device=x.device))
        return self.head(x) + 0.01 * penalty


def hooked_net(width: int = 16, num_classes: int = 5, store: bool | None = True) -> nn.Module:
    return HookedNet(width, num_classes, store)


class SharedHookedNet(nn.Module):
    """One activation module called twice (no segment, but an op range re-runs it as a call),
    with a forward hook collecting its outputs, between Linears and own code. Input [N, width]."""

    def __init__(self, width: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.mid = nn.Linear(4 * width, 4 * width)
        self.head = nn.Linear(4 * width, num_classes)
        self.features: list[torch.Tensor] = []
        self.act.register_forward_hook(lambda module, args, output: self.features.append(output))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.features.clear()
        h = self.act(self.up(x)) * 2.0
        h = self.act(self.mid(h)) + 1.0
        return self.head(h) + 0.01 * self.features[0].mean()


def shared_hook_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    return SharedHookedNet(width, num_classes)


class _SelfSavingBlock(nn.Module):
    def __init__(self, width: int, how: str) -> None:
        super().__init__()
        self.a = nn.Linear(width, 4 * width)
        self.b = nn.Linear(4 * width, width)
        self.how = how

    def inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.how == "save_on_cpu":
            with torch.autograd.graph.save_on_cpu():
                return x + self.inner(x)
        if self.how in ("reentrant", "non-reentrant"):
            return x + torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=self.how == "reentrant")
        return x + self.inner(x)


def self_saving_net(width: int = 16, num_classes: int = 5, how: str = "non-reentrant") -> nn.Module:
    """Research code that decides itself how its blocks save for backward: ``how`` is
    ``reentrant`` or ``non-reentrant`` checkpoint, or ``save_on_cpu``, in every other block
    (``none``: plain blocks). Input [N, width]."""
    blocks = [_SelfSavingBlock(width, how if i % 2 == 0 else "none") for i in range(4)]
    return nn.Sequential(*blocks, nn.Linear(width, num_classes))


class RoutedNet(nn.Module):
    """Top-1 routing by value, as mixture-of-experts layers do it: each row goes to the expert
    its router scores highest, gathered with ``nonzero``, so the experts' shapes depend on the
    data. Input [N, width]."""

    def __init__(self, width: int = 16, num_classes: int = 5) -> None:
        super().__init__()
        self.router = nn.Linear(width, 2)
        self.experts = nn.ModuleList(nn.Linear(width, width) for _ in range(2))
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        choice = self.router(x).argmax(dim=-1)
        out = torch.zeros_like(x)
        for k, expert in enumerate(self.experts):
            rows = (choice == k).nonzero().squeeze(-1)
            out = out.index_add(0, rows, expert(x[rows]))
        return self.head(out)


def routed_net(width: int = 16, num_classes: int = 5) -> nn.Module:
    return RoutedNet(width, num_classes)
