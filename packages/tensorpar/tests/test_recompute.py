"""`recompute(block)`: the same forward values, gradients and dropout streams as without it.

A tensorpar block with dropout 0.3 (residual and attention-probability masks
from its TensorParallelRNG) runs two training steps with and without
recomputation, from equal weights and streams: outputs, every gradient and
the generators' states after each step must be equal bit for bit (the
recomputation replays the forward's masks and leaves the streams where the
forward left them). torch.utils.checkpoint alone, which only replays torch's
global generator, must fail the same comparison: that is what the replay is for.
"""

from __future__ import annotations

import copy

import torch
from torch.utils.checkpoint import checkpoint

from capstan import comm
from capstan.tensorpar import ParallelBlock, TensorParallelRNG, is_recomputed, recompute


def _block() -> ParallelBlock:
    group = comm.single_process_groups().tp
    torch.manual_seed(0)
    return ParallelBlock(32, 4, group, TensorParallelRNG(group, seed=5), dropout=0.3, seed=11, n_layers=2)


def _steps(block: ParallelBlock, wrap=None) -> list:
    out = []
    for step in range(2):
        x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(step), requires_grad=True)
        y = wrap(block, x) if wrap else block(x)
        (y * y).sum().backward()
        grads = {n: p.grad.clone() for n, p in block.named_parameters()}
        states = {k: v.clone() for k, v in block.rng.get_states().items()}
        out.append((y.detach(), x.grad.clone(), grads, states))
        block.zero_grad(set_to_none=True)
    return out


def _equal(a: list, b: list) -> bool:
    for (ya, xa, ga, sa), (yb, xb, gb, sb) in zip(a, b, strict=True):
        if not (torch.equal(ya, yb) and torch.equal(xa, xb) and ga.keys() == gb.keys() and sa.keys() == sb.keys()):
            return False
        if not all(torch.equal(ga[k], gb[k]) for k in ga) or not all(torch.equal(sa[k], sb[k]) for k in sa):
            return False
    return True


def test_recomputed_block_trains_exactly_like_the_plain_one() -> None:
    plain = _block()
    want = _steps(plain)
    block = recompute(_block())
    assert is_recomputed(block) and recompute(block) is block
    assert [n for n, _ in block.named_parameters()] == [n for n, _ in plain.named_parameters()]
    assert _equal(_steps(block), want)


def test_checkpoint_without_the_replay_gets_other_masks() -> None:
    want = _steps(_block())
    got = _steps(_block(), wrap=lambda b, x: checkpoint(b, x, use_reentrant=False))
    assert not _equal(got, want)


def test_recompute_saves_activation_memory_and_skips_without_grad() -> None:
    """Fewer tensors saved for backward; under no_grad no checkpoint at all (same output as plain)."""
    def saved_bytes(block: torch.nn.Module) -> int:
        total = [0]

        def pack(t: torch.Tensor) -> torch.Tensor:
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            block(torch.randn(4, 64, 32, requires_grad=True)).sum()
        return total[0]

    plain, block = _block(), recompute(_block())
    assert saved_bytes(block) * 4 < saved_bytes(plain)
    plain.eval(), block.eval()
    x = torch.randn(2, 8, 32)
    with torch.no_grad():
        assert torch.equal(block(x), plain(x))


def test_a_block_without_rng_uses_torchs_replay() -> None:
    torch.manual_seed(1)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 8))
    ref = copy.deepcopy(net)
    x = torch.randn(4, 8)
    torch.manual_seed(7)
    ref(x).sum().backward()
    torch.manual_seed(7)
    recompute(net)(x).sum().backward()
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_deep_copy_recomputes_itself() -> None:
    """The installed forward is bound to the block: a copy (an EMA model, say) runs its own weights."""
    block = recompute(_block())
    twin = copy.deepcopy(block)
    with torch.no_grad():
        for p in twin.parameters():
            p.mul_(0.5)
    x = torch.randn(2, 8, 32, requires_grad=True)
    block.eval(), twin.eval()
    plain = _block()
    plain.load_state_dict(twin.state_dict())
    plain.eval()
    assert is_recomputed(twin) and torch.equal(twin(x), plain(x)) and not torch.equal(twin(x), block(x))
