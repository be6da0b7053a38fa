"""Forward/backward smoke tests for the example models in monet_cli.examples.models."""

from __future__ import annotations

import torch
from torch import nn

from monet_cli.examples.models import GPTBlock, skip_concat_net, small_mlp, tiny_gpt


def _assert_all_grads(model: nn.Module) -> None:
    missing = [name for name, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"parameters without gradient: {missing}"


def test_tiny_gpt_forward_backward() -> None:
    torch.manual_seed(0)
    model = tiny_gpt()
    assert isinstance(model.blocks, nn.ModuleList)
    assert len(model.blocks) == 4 and all(isinstance(b, GPTBlock) for b in model.blocks)
    idx = torch.randint(0, 512, (2, 16), dtype=torch.int64)
    logits = model(idx)
    assert logits.shape == (2, 16, 512)
    logits.float().mean().backward()
    _assert_all_grads(model)


def test_tiny_gpt_dropout_train_vs_eval() -> None:
    torch.manual_seed(0)
    model = tiny_gpt(n_layers=2)
    idx = torch.randint(0, 512, (2, 16), dtype=torch.int64)
    model.train()
    with torch.no_grad():
        torch.manual_seed(1)
        a = model(idx)
        torch.manual_seed(2)
        b = model(idx)
    assert not torch.allclose(a, b)
    model.eval()
    with torch.no_grad():
        torch.manual_seed(1)
        c = model(idx)
        torch.manual_seed(2)
        d = model(idx)
    assert torch.equal(c, d)


def test_tiny_gpt_is_causal() -> None:
    # Changing a later token must not change logits at earlier positions.
    torch.manual_seed(0)
    model = tiny_gpt(n_layers=2).eval()
    idx = torch.randint(0, 512, (1, 16), dtype=torch.int64)
    idx2 = idx.clone()
    idx2[0, 10] = (idx[0, 10] + 1) % 512
    with torch.no_grad():
        a, b = model(idx), model(idx2)
    torch.testing.assert_close(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_skip_concat_net_forward_backward() -> None:
    torch.manual_seed(0)
    model = skip_concat_net()
    assert any(isinstance(m, nn.ReLU) and m.inplace for m in model.modules())
    out = model(torch.randn(2, 3, 32, 32))
    assert out.shape == (2, 10)
    out.sum().backward()
    _assert_all_grads(model)


def test_small_mlp_forward_backward() -> None:
    torch.manual_seed(0)
    model = small_mlp()
    assert isinstance(model, nn.Sequential)
    out = model(torch.randn(2, 64))
    assert out.shape == (2, 10)
    out.sum().backward()
    _assert_all_grads(model)
