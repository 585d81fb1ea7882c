"""Tiled cross-entropy and tiled MLP (one process): the same losses and gradients as untiled.

fp32; 1e-6 norm-wise as test_layers.py (tiles reorder the sums of the head's weight gradient and of
the softmax). The tp = 2 cases (with and without sequence parallelism) run in test_context.py's job.
"""

from __future__ import annotations

import pytest
import torch

from capstan.comm import single_process_groups
from capstan.tensorpar import GPTConfig, build_gpt
from capstan.tensorpar.gpt import loss_targets
from capstan.tensorpar.testing import rel_err
from capstan.tensorpar.tiled_loss import tiled_head_cross_entropy

TOL = 1e-6


def _batch(vocab: int, seq: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, vocab, (2, seq + 1), generator=torch.Generator().manual_seed(seed))
    return tokens[:, :-1], tokens[:, 1:]


def _run(cfg: GPTConfig, tiled: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = build_gpt(cfg, single_process_groups().tp, seed=3)
    ids, tgt = _batch(cfg.vocab_size, cfg.seq_len)
    with loss_targets(tgt if tiled else None):
        out = model(ids)
    loss = model.loss(out, tgt)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize(("loss_tile", "mlp_tile"), [(5, 0), (-1, 0), (0, 6), (7, 4)])
def test_tiled_loss_and_mlp_equal_untiled(loss_tile: int, mlp_tile: int) -> None:
    base = dict(vocab_size=51, seq_len=16, d_model=32, n_heads=4, n_layers=2, dropout=0.0)
    ref_loss, ref_grads = _run(GPTConfig(**base), tiled=False)
    loss, grads = _run(GPTConfig(**base, loss_tile=loss_tile, mlp_tile=mlp_tile), tiled=True)
    assert rel_err(loss, ref_loss) <= TOL
    for name, g in ref_grads.items():
        assert rel_err(grads[name], g) <= TOL, name


def test_tiled_head_logits_never_exist_whole_and_any_gradient_works() -> None:
    """A per-token gradient other than a mean takes the recomputing backward: same gradients as untiled."""
    from capstan.tensorpar.cross_entropy import vocab_parallel_cross_entropy

    group = single_process_groups().tp
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 10, 16, generator=g, requires_grad=True)
    w = torch.randn(40, 16, generator=g, requires_grad=True)
    t = torch.randint(0, 37, (3, 10), generator=g)
    weights = torch.rand(3, 10, generator=g)
    ref = (vocab_parallel_cross_entropy(h @ w.t(), t, group, 37) * weights).sum()
    ref.backward()
    want = (h.grad.clone(), w.grad.clone())
    h.grad = w.grad = None
    got = (tiled_head_cross_entropy(h, w, t, group, 37, tile=4) * weights).sum()
    got.backward()
    assert rel_err(got, ref) <= TOL and rel_err(h.grad, want[0]) <= TOL and rel_err(w.grad, want[1]) <= TOL


def test_a_caller_that_takes_the_mean_skips_the_uniformity_check() -> None:
    """uniform_grad=True (the GPT head under loss_targets, whose losses are averaged) scales the unit
    gradients without comparing every token's gradient with the first (a host sync on a GPU): the same
    gradients as the checked path, bit for bit."""
    torch.manual_seed(0)
    group = single_process_groups().tp
    h, w, t = torch.randn(12, 8), torch.randn(20, 8), torch.randint(0, 20, (12,))
    grads = []
    for uniform in (False, True):
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        tiled_head_cross_entropy(hh, ww, t, group, tile=5, uniform_grad=uniform).mean().backward()
        grads.append((hh.grad, ww.grad))
    assert torch.equal(grads[0][0], grads[1][0]) and torch.equal(grads[0][1], grads[1][1])
