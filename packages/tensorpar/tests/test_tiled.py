"""Tiled cross-entropy and tiled MLP (one process): the same losses and gradients as untiled.

fp32; 1e-6 norm-wise as test_layers.py (tiles reorder the sums of the head's weight gradient and of
the softmax). The tp = 2 cases (with and without sequence parallelism) run in test_context.py's job.
"""

from __future__ import annotations

import pytest
import torch

from capstan.comm import single_process_groups
from capstan.native import standin
from capstan.tensorpar import GPTConfig, build_gpt
from capstan.tensorpar.modules.gpt import loss_targets
from capstan.tensorpar.modules.tiled_loss import tiled_head_cross_entropy
from capstan.tensorpar.testing import rel_err

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
    from capstan.tensorpar.modules.cross_entropy import vocab_parallel_cross_entropy

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


def _peak_bytes(device: str, run) -> int:
    """Peak bytes the device allocator handed out while `run()` ran, beyond what was allocated before: what
    the tensors really took, not a counter kept by the code under test."""
    mod = getattr(torch, device)
    mod.synchronize()
    base = mod.memory_allocated()
    mod.reset_peak_memory_stats()
    run()
    mod.synchronize()
    return mod.max_memory_allocated() - base


@pytest.mark.parametrize("device", [standin.param()])
def test_the_default_tile_on_an_accelerator_is_sixteen_times_the_cpus(device: str) -> None:
    """On a GPU each tile launches ~25 kernels and adds the head's whole gradient in fp32: 4M-logit tiles made
    capstan's step 0.33x plain PyTorch's on an H200 (50 tiles for 4,096 tokens x 50,304). The model's head
    picks the tile by where its input is: 16x more tokens a tile there (one tile for this whole batch)."""
    from capstan.tensorpar.modules.tiled_loss import DEVICE_TILE_ELEMENTS, TILE_ELEMENTS, default_tile

    assert (default_tile(50304), default_tile(50304, device)) == (83, 1334)
    assert DEVICE_TILE_ELEMENTS == 16 * TILE_ELEMENTS
    cfg = GPTConfig(vocab_size=4096, seq_len=64, d_model=16, n_heads=2, n_layers=1, dropout=0.0, loss_tile=-1)
    for where in ("cpu", device):
        torch.manual_seed(0)
        model = build_gpt(cfg, single_process_groups().tp, seed=0).to(where)
        x = torch.randint(0, 4096, (32, 65)).to(where)
        with loss_targets(x[:, 1:]):
            model(x[:, :-1])
        head = model.layers[-1]
        tile = TILE_ELEMENTS // 4096 if where == "cpu" else 32 * 64  # 1,024 tokens a tile, or all 2,048
        assert head.take_logits_peak() == tile * 4096 * 4, where


@pytest.mark.parametrize("device", [standin.param()])
def test_tiled_head_holds_one_tile_of_logits_on_the_device_not_all(device: str) -> None:
    """The tiled loss's memory, measured by the stand-in device's allocator: forward and backward of the
    untiled head take more than the whole fp32 logits (8 MiB here); the tiled one stays under a quarter
    of that (its tile of 32 tokens is 512 KiB), a bound whole logits would break."""
    from capstan.tensorpar.modules.cross_entropy import vocab_parallel_cross_entropy

    group = single_process_groups().tp
    vocab, tokens, hidden = 4096, 512, 16
    logits = tokens * vocab * 4
    g = torch.Generator().manual_seed(3)
    h = torch.randn(1, tokens, hidden, generator=g).to(device).requires_grad_()
    w = torch.randn(vocab, hidden, generator=g).to(device).requires_grad_()
    t = torch.randint(0, vocab, (1, tokens), generator=g).to(device)

    def whole() -> None:
        vocab_parallel_cross_entropy(h @ w.t(), t, group, vocab).mean().backward()

    def tiled() -> None:
        tiled_head_cross_entropy(h, w, t, group, vocab, tile=32).mean().backward()

    assert _peak_bytes(device, whole) >= logits
    want = (h.grad.cpu(), w.grad.cpu())
    h.grad = w.grad = None
    peak = _peak_bytes(device, tiled)
    assert peak < logits // 4, (peak, logits)
    assert rel_err(h.grad.cpu(), want[0]) <= TOL and rel_err(w.grad.cpu(), want[1]) <= TOL


@pytest.mark.parametrize("device", [standin.param()])
def test_tiled_mlp_holds_one_tile_of_hidden_activations_on_the_device_not_all(device: str) -> None:
    """The tiled MLP's memory, measured by the stand-in device's allocator: the untiled MLP keeps its
    ffn-wide activations of the whole sequence for backward (fc output and GeLU: 2 x 4 MiB here); tiles of
    64 tokens recompute them in backward and stay under half of one of them."""
    from capstan.tensorpar.modules.blocks import ParallelMLP

    group = single_process_groups().tp
    tokens, d_model, d_ffn = 1024, 64, 1024
    hidden_bytes = tokens * d_ffn * 4
    x = torch.randn(1, tokens, d_model, generator=torch.Generator().manual_seed(4)).to(device)
    peaks, grads = {}, {}
    for tile in (0, 64):
        mlp = ParallelMLP(d_model, d_ffn, group, seed=5, tile=tile).to(device)
        inp = x.clone().requires_grad_()
        peaks[tile] = _peak_bytes(device, lambda: mlp(inp).sum().backward())  # noqa: B023
        grads[tile] = inp.grad.cpu()
    assert peaks[0] >= 2 * hidden_bytes, peaks
    assert peaks[64] < hidden_bytes // 2, peaks
    assert rel_err(grads[64], grads[0]) <= TOL


def test_under_autocast_the_head_and_its_input_are_cast_once_not_in_every_tile() -> None:
    """Autocast casts a matmul's fp32 inputs at every call, and a view such as w.t() misses its weight cache:
    four tiles cast the whole head 8 times (an H200 step launched ~740 kernels, host-bound: docs/benchmarks.md
    "GPU"). The tiled loss casts the head and its input once, and the losses and gradients are the same bits."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Casts(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.numels: list[int] = []  # of the fp32 tensors cast

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._to_copy.default and args[0].dtype == torch.float32:
                self.numels.append(args[0].numel())
            return func(*args, **(kwargs or {}))

    group = single_process_groups().tp
    torch.manual_seed(0)
    h0, w0, t = torch.randn(96, 32), torch.randn(500, 32), torch.randint(0, 500, (96,))
    got = []
    for tile in (24, 96):  # four tiles, one
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        with Casts() as casts, torch.autocast("cpu", dtype=torch.bfloat16):
            losses = tiled_head_cross_entropy(h, w, t, group, 500, tile=tile, uniform_grad=True)
        assert casts.numels.count(w0.numel()) == 1, casts.numels  # the head, once
        assert casts.numels.count(h0.numel()) == 1 and 24 * 32 not in casts.numels, casts.numels  # its input, whole
        losses.mean().backward()
        got.append((losses.detach(), h.grad, w.grad))
    (l4, gh4, gw4), (l1, gh1, gw1) = got
    assert torch.equal(l4, l1) and rel_err(gh4, gh1) < 1e-6 and rel_err(gw4, gw1) < 1e-2


def test_the_tiled_loss_runs_on_the_meta_device() -> None:
    """The planner counts a forward on the meta device, head and loss included: asking autocast about a
    device type it does not know raises there, so the one-time cast must not ask."""
    group = single_process_groups().tp
    h = torch.empty(8, 4, device="meta", requires_grad=True)
    w = torch.empty(10, 4, device="meta", requires_grad=True)
    losses = tiled_head_cross_entropy(h, w, torch.zeros(8, dtype=torch.long, device="meta"), group, 10, tile=3,
                                      uniform_grad=True)
    assert losses.shape == (8,) and losses.is_meta
