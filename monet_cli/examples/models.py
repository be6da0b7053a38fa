"""Small, real example models for monet.

Each public function is a factory with keyword arguments with defaults that returns an
``nn.Module``; load one through an import path such as
``monet_cli.examples.models:tiny_gpt``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTBlock", "TinyGPT", "SkipConcatNet", "tiny_gpt", "skip_concat_net", "small_mlp"]


# --------------------------------------------------------------------------- GPT


class GPTBlock(nn.Module):
    """Pre-LayerNorm transformer decoder block: causal self-attention, then an MLP."""

    def __init__(self, d_model: int, n_heads: int, dropout: float) -> None:
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(f"d_model ({d_model}) must be divisible by n_heads ({n_heads})")
        self.n_heads = n_heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(d_model)
        # One fused projection for q, k and v: a single matmul instead of three.
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.resid_drop = nn.Dropout(dropout)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(
            nn.Linear(d_model, 4 * d_model),
            nn.GELU(),
            nn.Linear(4 * d_model, d_model),
            nn.Dropout(dropout),
        )

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        n, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=-1)
        # [N, T, D] -> [N, H, T, D/H], the layout scaled_dot_product_attention expects.
        q, k, v = (z.view(n, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).reshape(n, t, d)
        return self.resid_drop(self.proj(y))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Out-of-place residuals keep each block's input alive for autograd, as in real GPTs.
        x = x + self.attention(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class TinyGPT(nn.Module):
    """GPT-style decoder-only language model; see :func:`tiny_gpt`."""

    def __init__(
        self,
        vocab_size: int,
        seq_len: int,
        d_model: int,
        n_layers: int,
        n_heads: int,
        dropout: float,
    ) -> None:
        super().__init__()
        self.seq_len = seq_len
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(seq_len, d_model)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(GPTBlock(d_model, n_heads, dropout) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len {self.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def tiny_gpt(
    vocab_size: int = 512,
    seq_len: int = 64,
    d_model: int = 128,
    n_layers: int = 4,
    n_heads: int = 4,
    dropout: float = 0.1,
) -> nn.Module:
    """Build a small GPT-style decoder.

    Input: int64 token ids of shape ``[N, T]`` with ``T <= seq_len`` and values in
    ``[0, vocab_size)``. Output: logits of shape ``[N, T, vocab_size]``.
    """
    return TinyGPT(vocab_size, seq_len, d_model, n_layers, n_heads, dropout)


# --------------------------------------------------------------------------- U-Net-like CNN


def _conv_bn_relu(in_ch: int, out_ch: int) -> nn.Sequential:
    # Two 3x3 convs per stage, as in U-Net. bias=False because BatchNorm adds its own shift.
    # inplace=True mirrors torchvision, so monet is exercised on in-place activations.
    return nn.Sequential(
        nn.Conv2d(in_ch, out_ch, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
        nn.Conv2d(out_ch, out_ch, 3, padding=1, bias=False),
        nn.BatchNorm2d(out_ch),
        nn.ReLU(inplace=True),
    )


class SkipConcatNet(nn.Module):
    """Small U-Net-like classifier with concatenation skips; see :func:`skip_concat_net`."""

    def __init__(self, in_channels: int, base: int, num_classes: int) -> None:
        super().__init__()
        c1, c2, c3 = base, 2 * base, 4 * base
        self.enc1 = _conv_bn_relu(in_channels, c1)  # full resolution
        self.enc2 = _conv_bn_relu(c1, c2)  # 1/2
        self.pool = nn.MaxPool2d(2)
        self.bottleneck = _conv_bn_relu(c2, c3)  # 1/4
        self.up2 = nn.ConvTranspose2d(c3, c2, kernel_size=2, stride=2)
        self.dec2 = _conv_bn_relu(c2 + c2, c2)  # input: upsampled + enc2 skip
        self.up1 = nn.ConvTranspose2d(c2, c1, kernel_size=2, stride=2)
        self.dec1 = _conv_bn_relu(c1 + c1, c1)  # input: upsampled + enc1 skip
        self.head = nn.Linear(c1, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        e1 = self.enc1(x)
        e2 = self.enc2(self.pool(e1))
        b = self.bottleneck(self.pool(e2))
        # Concatenation skips keep encoder activations alive until the decoder uses them.
        d2 = self.dec2(torch.cat([self.up2(b), e2], dim=1))
        d1 = self.dec1(torch.cat([self.up1(d2), e1], dim=1))
        return self.head(d1.mean(dim=(2, 3)))  # global average pooling


def skip_concat_net(in_channels: int = 3, base: int = 8, num_classes: int = 10) -> nn.Module:
    """Build a small U-Net-like CNN classifier with BatchNorm and concatenation skips.

    Input: float images of shape ``[N, in_channels, H, W]`` with ``H`` and ``W``
    divisible by 4 (e.g. 32x32). Output: logits of shape ``[N, num_classes]``.
    """
    return SkipConcatNet(in_channels, base, num_classes)


# --------------------------------------------------------------------------- MLP


def small_mlp(in_features: int = 64, hidden: int = 128, depth: int = 3, num_classes: int = 10) -> nn.Module:
    """Build an ``nn.Sequential`` MLP with ``depth`` Linear+ReLU hidden layers and a Linear head.

    Input: float features of shape ``[N, in_features]``. Output: logits ``[N, num_classes]``.
    """
    layers: list[nn.Module] = []
    width = in_features
    for _ in range(depth):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
        width = hidden
    layers.append(nn.Linear(width, num_classes))
    return nn.Sequential(*layers)
