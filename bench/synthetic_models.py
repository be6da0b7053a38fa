"""Generated models for solver benchmarks, loaded through import paths.

``bench.synthetic_models:chain`` and ``bench.synthetic_models:skip_dag`` build real
``nn.Module``s that monet profiles with its real profiler. Every block is its own
module (a checkpoint segment candidate) with its own sub-modules (nested candidates);
widths and block kinds come from a seeded RNG so the chain is heterogeneous: segments
differ in saved bytes and recompute time, so the solver has real trade-offs to make.

Input: ``[N, width]`` features (``--input-shape WIDTH``). The output is ``[N, classes]``
logits, so monet's ``auto`` loss is cross-entropy.
"""

from __future__ import annotations

import random

import torch
from torch import nn

__all__ = ["Chain", "SkipDAG", "chain", "skip_dag", "block_kinds"]

KINDS = ("linear_relu", "linear_ln_gelu", "mlp_gelu", "linear_tanh")


def block_kinds() -> tuple[str, ...]:
    return KINDS


def _block(kind: str, d_in: int, d_out: int, rng: random.Random) -> nn.Sequential:
    """One block: its own module holding its layers directly (no extra nesting level)."""
    if kind == "linear_relu":
        return nn.Sequential(nn.Linear(d_in, d_out), nn.ReLU())
    if kind == "linear_ln_gelu":
        return nn.Sequential(nn.Linear(d_in, d_out), nn.LayerNorm(d_out), nn.GELU())
    if kind == "mlp_gelu":
        hidden = rng.choice((d_out, 2 * d_out))
        return nn.Sequential(nn.Linear(d_in, hidden), nn.GELU(), nn.Linear(hidden, d_out))
    if kind == "linear_tanh":
        return nn.Sequential(nn.Linear(d_in, d_out), nn.Tanh())
    raise ValueError(f"unknown block kind {kind!r}")


def _widths(width: int) -> tuple[int, ...]:
    return (max(8, width // 2), width, 2 * width, 3 * width)


class Chain(nn.Module):
    """``n_blocks`` heterogeneous blocks in sequence, then a linear head."""

    def __init__(self, n_blocks: int, width: int, classes: int, seed: int) -> None:
        super().__init__()
        rng = random.Random(seed)
        d = width
        blocks = []
        self.kinds: list[str] = []
        for _ in range(n_blocks):
            kind = rng.choice(KINDS)
            d_out = rng.choice(_widths(width))
            blocks.append(_block(kind, d, d_out, rng))
            self.kinds.append(kind)
            d = d_out
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


class SkipBlock(nn.Module):
    """A block that may join a skip input from an earlier block (``add`` or ``cat``) first.

    Its layers are its direct children (a ModuleList is never called), so the module
    tree is block -> layers, as in ``Chain``.
    """

    def __init__(self, kind: str, join: str | None, d_in: int, d_skip: int, d_out: int, rng: random.Random) -> None:
        super().__init__()
        self.join = join
        width_in = d_in + d_skip if join == "cat" else d_in
        self.layers = nn.ModuleList(_block(kind, width_in, d_out, rng))

    def forward(self, x: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        if self.join == "add":
            x = x + skip
        elif self.join == "cat":
            x = torch.cat([x, skip], dim=-1)
        for layer in self.layers:
            x = layer(x)
        return x


class SkipDAG(nn.Module):
    """Blocks where some take a second input from an earlier block: the graph is a DAG.

    Block i (i >= 2) gets a skip from the output of a random block 0..i-2 with probability
    ``skip_prob``: added (half the time, when some earlier output has its input's width)
    or concatenated. The skip source stays alive until its consumer runs, and a
    checkpointed consumer holds it until its own backward: segments interact.
    """

    def __init__(self, n_blocks: int, width: int, classes: int, seed: int, skip_prob: float) -> None:
        super().__init__()
        rng = random.Random(seed)
        outs = [width]  # widths of x (index 0) and every block output (index i + 1)
        blocks = []
        self.sources: list[int | None] = []
        self.joins: list[str | None] = []
        self.kinds: list[str] = []
        for i in range(n_blocks):
            kind = rng.choice(KINDS)
            d_in = outs[-1]
            # A skip comes from an earlier block's output, never the block right before (that is x).
            source, join = None, None
            if i >= 2 and rng.random() < skip_prob:
                same_width = [j for j in range(1, i) if outs[j] == d_in]
                if same_width and rng.random() < 0.5:
                    source, join = rng.choice(same_width), "add"
                else:
                    source, join = rng.randrange(1, i), "cat"
            d_out = rng.choice(_widths(width))
            blocks.append(SkipBlock(kind, join, d_in, outs[source] if source is not None else 0, d_out, rng))
            self.sources.append(source)
            self.joins.append(join)
            self.kinds.append(kind)
            outs.append(d_out)
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(outs[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = [x]
        for block, source in zip(self.blocks, self.sources):
            outs.append(block(outs[-1], None if source is None else outs[source]))
        return self.head(outs[-1])


def chain(n_blocks: int = 6, width: int = 64, classes: int = 10, seed: int = 0) -> nn.Module:
    return Chain(n_blocks, width, classes, seed)


def skip_dag(n_blocks: int = 6, width: int = 64, classes: int = 10, seed: int = 0, skip_prob: float = 0.6) -> nn.Module:
    return SkipDAG(n_blocks, width, classes, seed, skip_prob)
