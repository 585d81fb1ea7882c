"""Cross-entropy over a vocabulary split across the tensor-parallel group.

Megatron-LM (Shoeybi et al. 2019, section 3, last paragraph): gathering the
logits [b, s, vocab] would move b*s*vocab numbers per step; instead each rank
keeps its [b, s, vocab/tp] slice and the softmax is assembled from three
all-reduces of [b, s] scalars: the max (for a stable exponent), the sum of
exponentials, and the target's logit (only the owning rank contributes it).

    loss = log(sum_j exp(z_j - m)) - (z_target - m)
    d loss / d z_j = softmax_j - [j == target]   (computed locally per slice)

Padded vocabulary columns (see `VocabParallelEmbedding`) are excluded by
passing ``vocab_size``: they are set to -inf, so they weigh nothing.
"""

from __future__ import annotations

import torch

from capstan import comm
from capstan.comm import Group

from ..slicing.mappings import gather_from_tensor_parallel_region

__all__ = ["vocab_parallel_cross_entropy", "gather_vocab_logits"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, target: torch.Tensor, group: Group, vocab_size: int | None):
        # logits: [..., v_local] this rank's vocabulary slice; target: [...] global ids
        v_local = logits.shape[-1]
        start = group.rank * v_local
        z = logits.float()
        if vocab_size is not None and start + v_local > vocab_size:
            z = z.clone()
            z[..., max(vocab_size - start, 0):] = float("-inf")
        z_max = z.max(dim=-1).values  # [...]
        comm.all_reduce(z_max, "max", group=group)
        shifted = z - z_max.unsqueeze(-1)
        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)  # [...]
        comm.all_reduce(sum_exp, "sum", group=group)

        local_t = target - start
        outside = (local_t < 0) | (local_t >= v_local)
        local_t = local_t.masked_fill(outside, 0)
        target_logit = shifted.gather(-1, local_t.unsqueeze(-1)).squeeze(-1)
        target_logit = target_logit.masked_fill(outside, 0.0).contiguous()
        comm.all_reduce(target_logit, "sum", group=group)

        loss = sum_exp.log() - target_logit  # [...]
        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_t, outside)
        ctx.in_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax.clone()
        onehot = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -onehot.unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad.to(ctx.in_dtype), None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, group: Group, vocab_size: int | None = None
) -> torch.Tensor:
    """Per-token loss [...] from vocabulary-split logits [..., vocab_padded/tp] and target ids [...].

    Never materializes the full logits. vocab_size: the real vocabulary when
    the split one is padded (padded columns are ignored). Identical on every
    rank of the group. On a group of one this is F.cross_entropy(reduction="none").
    """
    if target.shape != logits.shape[:-1]:
        raise ValueError(f"target shape {tuple(target.shape)} does not match logits {tuple(logits.shape)}[:-1]")
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size)


def gather_vocab_logits(logits: torch.Tensor, group: Group, vocab_size: int | None = None) -> torch.Tensor:
    """All-gather vocabulary-split logits into [..., vocab] (for sampling or tests, not for the loss)."""
    full = gather_from_tensor_parallel_region(logits, group)
    return full if vocab_size is None else full[..., :vocab_size]
