"""The LM head and its cross-entropy in sequence tiles: the [tokens x vocabulary] logits never exist whole.

    losses = tiled_head_cross_entropy(hidden, head.weight, targets, group, vocab_size, tile=2048)   # [tokens]

For a long sequence the logits are the largest activation there is (seq x vocab fp32, and their
softmax beside them: 2 x 4 x 1M x 50k bytes = 400 GB for a 1M-token sequence). Here the head's matmul
and the vocab-parallel cross-entropy (cross_entropy.py: the max, the sum of exponentials and the target
logit all-reduced over the tp group, as Megatron does) run `tile` tokens at a time, and each tile's
gradient is formed at once (ALST, Bekman et al. 2025, "tiled loss"; Liger's fused linear
cross-entropy): d loss_i / d z = softmax(z_i) - onehot(target_i) needs nothing from later tiles, so
forward keeps d/dh (tokens x hidden, the size of the head's input) and d/dW (the head's size) for a
unit gradient per token, and backward scales them. That holds when every token's loss has the same
gradient (a mean, the engine's case); any other gradient recomputes the tiles' logits in backward.
So the tiled loss costs no extra compute where it is used, and it is on by default in the engine
(`memory.tiled_loss`). Padded vocabulary columns (tp padding) are excluded as in cross_entropy.py.
"""

from __future__ import annotations

import torch

from capstan import comm
from capstan.comm import Group

__all__ = ["tiled_head_cross_entropy", "default_tile"]

TILE_ELEMENTS = 1 << 22  # logits per tile (16 MiB in fp32) on the CPU unless told otherwise
# On an accelerator a tile is 16x larger (256 MiB of fp32 logits): every tile launches ~25 kernels and adds
# the head's whole gradient in fp32 once, so 4M-logit tiles cost a GPT-2-sized head (4,096 tokens x 50,304)
# 50 tiles, 31.8 ms of host time and 12 ms of casts a step on an H200, 0.33x plain PyTorch's step (first
# lease, docs/benchmarks.md "GPU"). A few tiles keep the logits bounded at a fraction of a GPU's memory.
DEVICE_TILE_ELEMENTS = 1 << 26


def default_tile(vocab_local: int, device: torch.device | str | None = None) -> int:
    """Tokens per tile: a tile's logits hold about TILE_ELEMENTS numbers (DEVICE_TILE_ELEMENTS on an
    accelerator: `device` is where the logits are formed)."""
    elements = TILE_ELEMENTS if device is None or torch.device(device).type == "cpu" else DEVICE_TILE_ELEMENTS
    return max(1, elements // max(1, vocab_local))


def _tile_softmax(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, group: Group, start: int, valid: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tile: (per-token loss, softmax over the local vocabulary, the local target index, whether the
    target is outside this rank's slice), the normalization reduced over the tp group."""
    z = torch.matmul(h, w.t()).float()  # [T, V/tp]
    if valid < z.shape[-1]:
        z[:, valid:] = float("-inf")
    z_max = z.max(dim=-1).values
    comm.all_reduce(z_max, "max", group=group)
    z = z - z_max.unsqueeze(-1)
    p = z.exp()
    total = p.sum(dim=-1)
    comm.all_reduce(total, "sum", group=group)
    local = t - start
    outside = (local < 0) | (local >= z.shape[-1])
    local = local.masked_fill(outside, 0)
    target_z = z.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0).contiguous()
    comm.all_reduce(target_z, "sum", group=group)
    loss = total.log() - target_z
    p.div_(total.unsqueeze(-1))
    return loss, p, local, outside


def _compute_dtype(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """h and w in autocast's dtype, cast once for all tiles: autocast would cast them again in every tile's
    two matmuls (a view such as w.t() misses its weight cache), four launches and a cast of the whole head
    a tile; the matmuls see the same values either way. Outside autocast: as they are."""
    kind = h.device.type
    try:
        enabled = torch.is_autocast_enabled(kind)
    except RuntimeError:  # a device type autocast does not know (meta: the planner's counting forward)
        return h, w
    if not enabled:
        return h, w
    dtype = torch.get_autocast_dtype(kind)
    return h.to(dtype), w.to(dtype)


class _TiledHeadCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, group: Group, vocab: int | None,  # type: ignore[override]
                tile: int, uniform_grad: bool) -> torch.Tensor:
        # h: [N, d] tokens; w: [V/tp, d] this rank's vocabulary rows; t: [N] global target ids
        n, v_local = h.shape[0], w.shape[0]
        start = group.rank * v_local
        valid = v_local if vocab is None else max(0, min(v_local, vocab - start))
        losses = torch.empty(n, dtype=torch.float32, device=h.device)
        dh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        hc, wc = _compute_dtype(h, w)
        for a in range(0, n, tile):
            b = min(n, a + tile)
            loss, p, local, outside = _tile_softmax(hc[a:b], wc, t[a:b], group, start, valid)
            losses[a:b] = loss
            p.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(p.dtype).unsqueeze(-1))  # d loss / d z
            dh[a:b] = torch.matmul(p.to(wc.dtype), wc).float()
            dw += torch.matmul(p.t().to(hc.dtype), hc[a:b]).float()
        ctx.save_for_backward(h, w, t, dh, dw)
        ctx.group, ctx.vocab, ctx.tile, ctx.uniform_grad = group, vocab, tile, uniform_grad
        return losses

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        h, w, t, dh, dw = ctx.saved_tensors
        # A mean (or sum): the unit gradients formed in forward, scaled. The caller may say so (uniform_grad):
        # checking costs a host sync on an accelerator, in every backward.
        if ctx.uniform_grad or bool((grad == grad[0]).all()):
            g = grad[0]
            return (dh * g).to(h.dtype), (dw * g).to(w.dtype), None, None, None, None, None
        group, tile = ctx.group, ctx.tile  # any other gradient: the tiles again, each scaled per token
        start = group.rank * w.shape[0]
        valid = w.shape[0] if ctx.vocab is None else max(0, min(w.shape[0], ctx.vocab - start))
        gh = torch.empty(h.shape, dtype=torch.float32, device=h.device)
        gw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        for a in range(0, h.shape[0], tile):
            b = min(h.shape[0], a + tile)
            _, p, local, outside = _tile_softmax(h[a:b], w, t[a:b], group, start, valid)
            p.scatter_add_(-1, local.unsqueeze(-1), -(~outside).to(p.dtype).unsqueeze(-1))
            p.mul_(grad[a:b].unsqueeze(-1))
            gh[a:b] = torch.matmul(p.to(w.dtype), w).float()
            gw += torch.matmul(p.t().to(h.dtype), h[a:b]).float()
        return gh.to(h.dtype), gw.to(w.dtype), None, None, None, None, None


def _losses_only(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor, group: Group, vocab: int | None, tile: int
                 ) -> torch.Tensor:
    """The per-token losses alone, a tile at a time (no autograd)."""
    start = group.rank * w.shape[0]
    valid = w.shape[0] if vocab is None else max(0, min(w.shape[0], vocab - start))
    losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    for a in range(0, h.shape[0], tile):
        b = min(h.shape[0], a + tile)
        losses[a:b] = _tile_softmax(h[a:b], w, t[a:b], group, start, valid)[0]
    return losses


def tiled_head_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, group: Group,
                             vocab_size: int | None = None, tile: int | None = None,
                             uniform_grad: bool = False) -> torch.Tensor:
    """Per-token losses [...] of `hidden` [..., d] through a vocabulary-split head `weight` [V/tp, d] against
    `targets` [...] (module docstring); equal to vocab_parallel_cross_entropy of the head's logits.
    uniform_grad: the caller reduces the losses to their mean (or sum), so every token's gradient is the
    same and backward scales the unit gradients without checking (the check is a host sync on a GPU)."""
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} do not match hidden {tuple(hidden.shape)}[:-1]")
    tile = tile or default_tile(weight.shape[0], weight.device)
    if not (torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)):
        return _losses_only(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), group, vocab_size,
                            tile).view(targets.shape)  # evaluation: no unit gradients to form
    flat = _TiledHeadCrossEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, targets.reshape(-1), group,
                                        vocab_size, tile, uniform_grad)
    return flat.view(targets.shape)
