"""Registration in execution order: `order="trace"` packs modules as one forward first calls them.

The model builds its layers in another order than it runs them. Packed in
creation order, every chunk holds layers that run far apart, so under a
tight budget each chunk comes back from disk several times per step; packed
in traced order, a forward (and backward) sweeps the chunks once. Training
is the same either way and equals plain PyTorch.
"""

from __future__ import annotations

import math
import tempfile

import pytest
import torch
from torch import nn

from capstan.chunkmem import ChunkAdam, ChunkedModel, ChunkManager, DiskStore

D, LAYERS, CHUNK = 32, 12, 4096  # three 32x32 Linears per chunk
BUILD = [0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11]  # creation order of layer i (run in order 0..11)


class Shuffled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        for i in BUILD:
            self.add_module(f"l{i}", nn.Linear(D, D))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(LAYERS):
            x = torch.tanh(getattr(self, f"l{i}")(x))
        return x


def _data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step % 2)  # two batches, alternating: the loss falls
    x = torch.randn(8, D, generator=g)
    return x, x.flip(-1) * 0.5


def _reference(steps: int) -> list[float]:
    torch.manual_seed(0)
    net = Shuffled()
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1)
    out = []
    for s in range(steps):
        loss = nn.functional.mse_loss(net(_data(s)[0]), _data(s)[1])
        loss.backward()
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def _chunked(order: str, steps: int, tmp: str) -> tuple[list[float], ChunkedModel]:
    torch.manual_seed(0)
    net = Shuffled()
    example = (torch.zeros(1, D),) if order == "trace" else None
    manager = ChunkManager(5 * CHUNK * 4, DiskStore(tmp), audit=True)
    model = ChunkedModel(net, manager, CHUNK, order=order, example_inputs=example)
    opt = ChunkAdam(model, lr=1e-2, weight_decay=0.1)
    out = []
    for s in range(steps):
        manager.begin_step()
        loss = nn.functional.mse_loss(model(_data(s)[0]), _data(s)[1])
        model.backward(loss)
        opt.step()
        manager.end_step()
        out.append(loss.item())
    return out, model


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def test_traced_order_packs_chunks_in_execution_order_and_moves_less(tmp_path) -> None:
    want = _reference(6)
    moved = {}
    for order in ("modules", "trace"):
        got, model = _chunked(order, 6, str(tmp_path / order))
        assert _rel(got, want) <= 1e-6, (order, got, want)
        index = {home.name: home.index for _, home in model.named_chunk_params()}
        first = [f"l{i}.weight" for i in (range(3) if order == "trace" else BUILD[:3])]
        assert all(index[n] == 0 for n in first), index  # chunk 0 holds the first three layers of the order
        moved[order] = model.manager.stats()["moved_bytes"]
        model.manager.close()
    assert want[-1] < want[0]
    assert moved["trace"] < moved["modules"], moved


class _Positions(nn.Module):
    """Creates a tensor in its forward (as a GPT's position index does)."""

    def __init__(self) -> None:
        super().__init__()
        self.pos = nn.Embedding(4, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.pos(torch.arange(x.shape[0]) % 4)


def test_trace_runs_on_the_meta_device_and_keeps_eager_values_for_a_sequential_model(tmp_path) -> None:
    def build() -> nn.Module:
        return nn.Sequential(nn.Linear(16, 16), _Positions(), nn.LayerNorm(16), nn.Linear(16, 4))

    torch.manual_seed(1)
    eager = build()
    torch.manual_seed(1)
    with torch.device("meta"):
        lazy = build()
    model = ChunkedModel(lazy, ChunkManager(None), 1024, order="trace", example_inputs=(torch.zeros(2, 16),))
    got = model.state_tensors()
    assert all(torch.equal(got[n], p) for n, p in eager.named_parameters())
    x = torch.randn(3, 16)
    assert torch.allclose(model(x), eager(x))


def test_trace_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="needs example_inputs"):
        ChunkedModel(Shuffled(), ChunkManager(None), CHUNK, order="trace")
    with pytest.raises(ValueError, match="order must be one of"):
        ChunkedModel(Shuffled(), ChunkManager(None), CHUNK, order="execution")
    with pytest.raises(RuntimeError, match="order='trace' could not run one forward of Shuffled"):
        ChunkedModel(Shuffled(), ChunkManager(None), CHUNK, order="trace", example_inputs=(torch.zeros(2, 5),))


def test_atomic_subtrees_and_uncalled_modules() -> None:
    from capstan.chunkmem.model.order import module_order

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.Linear(4, 4)
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
            self.inp = nn.Linear(4, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.inp(x)
            return self.attn(h, h, h, need_weights=False)[0]

    names = [n for n, _ in module_order(Net(), "trace", (torch.zeros(1, 3, 4),), (nn.MultiheadAttention,))]
    # out_proj is never called (attention reads its weight directly): it follows its atomic parent.
    assert names == ["", "inp", "attn", "attn.out_proj", "unused"]


def _sharded(order: str) -> list[float]:
    from capstan import comm
    from capstan.chunkmem import ShardedChunkedModel

    torch.set_num_threads(1)
    dp = comm.build_groups(comm.Topology(dp=comm.world().size)).dp
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        manager = ChunkManager(None, DiskStore(tmp, rank=dp.rank))
        example = (torch.zeros(1, D),) if order == "trace" else None
        model = ShardedChunkedModel(Shuffled(), manager, CHUNK, group=dp, order=order, example_inputs=example)
        opt = ChunkAdam(model, lr=1e-2, weight_decay=0.1)
        out = []
        for s in range(4):
            x, y = _data(s)
            rows = slice(dp.rank * 4, (dp.rank + 1) * 4)
            loss = nn.functional.mse_loss(model(x[rows]), y[rows])
            model.backward(loss)
            opt.step()
            t = torch.tensor([loss.item()])
            comm.all_reduce(t, op="avg", group=dp)
            out.append(t.item())
        manager.close()
    return out


@pytest.mark.parametrize("order", ["trace", "modules"])
def test_sharded_model_takes_either_order(order: str) -> None:
    # In creation order the gradients reach their units out of layout order: the single open
    # reduction buffer is flushed early, partly filled, and the owners' GRAD chunks add up.
    from capstan.comm.testing import run_ranks

    want = _reference(4)
    for got in run_ranks(_sharded, 2, order, timeout=240):
        assert all(math.isclose(a, b, rel_tol=1e-6) for a, b in zip(got, want)), (got, want)


def test_a_materialized_trace_leaves_buffers_and_random_state_alone() -> None:
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5))
    before = {n: b.clone() for n, b in net.named_buffers()}
    x = torch.randn(8, 4) * 3 + 1
    rng = torch.random.get_rng_state()
    ChunkedModel(net, ChunkManager(None), 64, order="trace", example_inputs=(x,))
    assert all(torch.equal(b, before[n]) for n, b in net.named_buffers())
    assert torch.equal(torch.random.get_rng_state(), rng)
