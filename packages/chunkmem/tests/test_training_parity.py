"""A small GPT trained with chunks forced to disk every step equals plain PyTorch training.

Pure fp32: the chunked run performs the same element-wise operations as
torch.optim.AdamW on the same values, so the losses agree to rounding of the
reordered reductions (1e-6 relative is the issue's bar). Computed on a GPU the
same run is compared with the CPU reference within 1e-4 relative, TF32 off: its
kernels sum in other orders (capstan.comm.testing.devices).
"""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from capstan.chunkmem import BudgetError, ChunkAdam, ChunkedModel, ChunkKind, ChunkManager, DiskStore
from capstan.comm.testing import FP32_VS_CPU, cpu_arithmetic, cuda_param
from capstan.native import standin

VOCAB, SEQ, D, HEADS, LAYERS = 64, 16, 32, 4, 2
CHUNK = 4096  # elements: ~11 param chunks, x4 kinds, so the budget below forces disk traffic
# A compute device above RAM: a CPU stand-in here (the same moves, into separately counted
# buffers); on a machine with CUDA the real device is tested as well.
# "cpu": a device tier in RAM; "standin": an accelerator that is not the CPU (capstan.native.standin);
# "cuda" where there is a GPU (TF32 off: conftest.py)
DEVICES = ["cpu", standin.param(), cuda_param()]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.attn = nn.MultiheadAttention(D, HEADS, batch_first=True)
        self.ln2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.proj = nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.full((x.shape[1], x.shape[1]), float("-inf"), device=x.device), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.proj(torch.relu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, tied: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.wpe = nn.Embedding(SEQ, D)
        self.blocks = nn.Sequential(*[Block() for _ in range(LAYERS)])
        self.ln_f = nn.LayerNorm(D)
        self.head = nn.Linear(D, VOCAB, bias=False)
        if tied:
            self.head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        logits = self.head(self.ln_f(self.blocks(x)))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


def _batches(steps: int, accum: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    # A learnable stream: each token determines the next ((3t + 1) mod VOCAB), random starts.
    g = torch.Generator().manual_seed(7)
    start = torch.randint(0, VOCAB, (steps * accum, 4, 1), generator=g)
    cols = [start]
    for _ in range(SEQ):
        cols.append((cols[-1] * 3 + 1) % VOCAB)
    data = torch.cat(cols, dim=-1)
    return [[(d[:, :-1], d[:, 1:]) for d in data[s * accum:(s + 1) * accum]] for s in range(steps)]


def _reference(steps: int, accum: int, tied: bool) -> list[float]:
    torch.manual_seed(0)
    model = TinyGPT(tied)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    losses = []
    for batch in _batches(steps, accum):
        total = 0.0
        for x, y in batch:
            loss = model(x, y) / accum
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def _chunked(steps: int, accum: int, tied: bool, eviction: str, budget: int | None, tmp_path,
             chunk: int = CHUNK) -> tuple[list[float], ChunkManager]:
    torch.manual_seed(0)
    net = TinyGPT(tied)
    disk = DiskStore(tmp_path) if tmp_path is not None else None
    manager = ChunkManager(budget, disk, eviction=eviction, audit=True)
    model = ChunkedModel(net, manager, chunk_size=chunk)
    opt = ChunkAdam(model, lr=3e-3, weight_decay=0.1)
    losses = []
    for batch in _batches(steps, accum):
        manager.begin_step()
        total = 0.0
        for x, y in batch:
            loss = model(x, y) / accum
            model.backward(loss)
            total += loss.item()
        opt.step()
        manager.end_step()
        losses.append(total)
    return losses, manager


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


BUDGET = 12 * CHUNK * 4  # 12 chunks of 44: every step streams most of them through disk


@pytest.mark.parametrize("eviction", ["belady", "lru"])
@pytest.mark.parametrize("accum", [1, 2])
def test_disk_offloaded_training_matches_plain_pytorch(eviction: str, accum: int, tmp_path) -> None:
    steps = 20
    want = _reference(steps, accum, tied=False)
    got, manager = _chunked(steps, accum, False, eviction, BUDGET, tmp_path)
    assert _rel(got, want) <= 1e-6, (got, want)
    assert want[-1] < want[0] - 0.3  # it learns, so the comparison is not of two flat lines
    stats = manager.stats()
    assert stats["cpu"]["peak_bytes"] <= BUDGET
    assert stats["disk"]["bytes_out"] > 20 * BUDGET  # data really came back from disk every step
    manager.close()


def test_tied_weights_and_everything_in_ram(tmp_path) -> None:
    want = _reference(5, 1, tied=True)
    got, manager = _chunked(5, 1, True, "belady", None, tmp_path)
    assert _rel(got, want) <= 1e-6
    assert manager.stats()["moved_bytes"] == 0
    manager.close()


@pytest.mark.parametrize("accum", [1, 3])
def test_unbounded_ram_accumulates_straight_into_gradient_chunks(accum: int) -> None:
    want = _reference(5, accum, tied=True)
    got, manager = _chunked(5, accum, True, "belady", None, None)
    assert _rel(got, want) <= 1e-6
    assert manager.stats()["moved_bytes"] == 0


def test_budget_below_the_working_set_is_refused_before_training(tmp_path) -> None:
    # The optimizer holds param, grad, exp_avg and exp_avg_sq of one chunk index at once: 4 chunks.
    need = 4 * CHUNK * 4
    with pytest.raises(BudgetError, match=f"below the working set: .* minimum budget for this model and chunk "
                                          f"size is {need} bytes"):
        ChunkedModel(TinyGPT(), ChunkManager(need - 1, DiskStore(tmp_path)), chunk_size=CHUNK)
    model = ChunkedModel(TinyGPT(), ChunkManager(need, DiskStore(tmp_path / "ok")), chunk_size=CHUNK)
    assert model.minimum_budget()[0] == need
    model.manager.close()


def test_budget_below_one_chunk_names_the_chunk_size(tmp_path) -> None:
    with pytest.raises(BudgetError, match=f"cpu budget of 100 bytes cannot hold one chunk of {CHUNK} elements "
                                          fr"\({CHUNK * 4} bytes\)"):
        ChunkedModel(TinyGPT(), ChunkManager(100, DiskStore(tmp_path)), chunk_size=CHUNK)
    with pytest.raises(BudgetError, match=r"cannot hold one chunk of \d+ elements \(\d+ bytes, the size chosen "
                                          r"for this model\)"):
        ChunkedModel(TinyGPT(), ChunkManager(100, DiskStore(tmp_path / "auto")), chunk_size=None)


def test_belady_moves_no_more_than_lru(tmp_path) -> None:
    moved = {}
    for policy in ("belady", "lru"):
        _, manager = _chunked(4, 1, False, policy, BUDGET, tmp_path / policy)
        moved[policy] = manager.stats()["moved_bytes"]
        manager.close()
    assert moved["belady"] <= moved["lru"], moved


class CheckpointedGPT(TinyGPT):
    """The same model with every block recomputed in backward (activation checkpointing)."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


@pytest.mark.parametrize("device", [None, *DEVICES])
def test_activation_checkpointing_with_chunks_on_disk(tmp_path, device: str | None) -> None:
    want = _reference(5, 1, tied=False)
    torch.manual_seed(0)
    net = CheckpointedGPT(False)
    manager = ChunkManager(BUDGET, DiskStore(tmp_path), audit=True, device=device,
                           device_budget=5 * CHUNK * 4 if device else None)
    model = ChunkedModel(net, manager, chunk_size=CHUNK)
    opt = ChunkAdam(model, lr=3e-3, weight_decay=0.1)
    got = []
    for batch in _batches(5, 1):
        manager.begin_step()
        loss = model(*(t.to(device or "cpu") for t in batch[0]))
        model.backward(loss)  # recomputation re-runs the forward hooks inside backward
        opt.step()
        manager.end_step()
        got.append(loss.item())
    tol = 1e-6 if cpu_arithmetic(device) else FP32_VS_CPU  # a GPU against the CPU reference
    assert _rel(got, want) <= tol, (got, want)
    assert manager.stats()["disk"]["bytes_out"] > 0
    manager.close()


def test_norm_weights_and_backward_driven_outside() -> None:
    # Two parameter groups; weight 0 drops group 1 from the norm (a caller's replicated group on a
    # rank that does not count it). Backward runs as a pipeline executor would: forwards of two
    # micro-batches inside saved_tensors(), torch.autograd.backward on each, then finish_backward().
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    ref = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4))
    ref.load_state_dict(net.state_dict())
    xs = [torch.randn(3, 8) for _ in range(2)]
    for x in xs:
        ref(x).square().mean().backward()
    want = math.sqrt(sum(float(p.grad.square().sum()) for p in ref[0].parameters()))
    model = ChunkedModel(net, ChunkManager(None), 256, param_groups=[["0.weight", "0.bias"], ["2.weight", "2.bias"]],
                         norm_weights=[1.0, 0.0], accumulate_grads=True)
    with model.saved_tensors():
        outs = [model.module(x).square().mean() for x in xs]
    for out in outs:
        torch.autograd.backward(out)
    model.finish_backward()
    assert all(h.pins == 0 for h in model.homes.values())
    assert ChunkAdam(model).grad_norm() == pytest.approx(want, rel=1e-6)
    with pytest.raises(ValueError, match="1 norm weights for 2 parameter groups"):
        ChunkedModel(nn.Linear(2, 2), ChunkManager(None), 256, param_groups=[["weight"], ["bias"]], norm_weights=[1.0])

DEVICE_BUDGET = 5 * CHUNK * 4  # 5 of the 22 PARAM + GRAD chunks: every step evicts from the device


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("eviction", "tied"), [("belady", False), ("lru", False), ("belady", True)])
def test_a_device_tier_above_ram_and_disk_trains_like_plain_pytorch(device: str, eviction: str, tied: bool,
                                                                     tmp_path) -> None:
    steps = 20
    want = _reference(steps, 1, tied=tied)
    torch.manual_seed(0)
    net = TinyGPT(tied)
    manager = ChunkManager(BUDGET, DiskStore(tmp_path), eviction=eviction, audit=True, device=device,
                           device_budget=DEVICE_BUDGET)
    model = ChunkedModel(net, manager, chunk_size=CHUNK)
    opt = ChunkAdam(model, lr=3e-3, weight_decay=0.1)
    to_device = manager.device_tier.to_device
    kinds_on_device: set[ChunkKind] = set()

    def spy(entry, fresh=None) -> None:
        kinds_on_device.add(entry.chunk.kind)
        to_device(entry, fresh)

    manager.device_tier.to_device = spy  # type: ignore[method-assign]
    got = []
    for batch in _batches(steps, 1):
        manager.begin_step()
        x, y = (t.to(device) for t in batch[0])
        loss = model(x, y)
        model.backward(loss)
        opt.step()
        manager.end_step()
        got.append(loss.item())
    tol = 1e-6 if cpu_arithmetic(device) else FP32_VS_CPU  # a GPU against the CPU reference
    assert _rel(got, want) <= tol, (got, want)
    stats = manager.stats()
    dev = stats["device" if device == "cpu" else device]
    assert dev["peak_bytes"] <= DEVICE_BUDGET and dev["evictions"] > 0
    assert dev["bytes_in"] > steps * DEVICE_BUDGET  # the parameters really went through the device
    assert stats["cpu"]["peak_bytes"] <= BUDGET
    assert stats["disk"]["bytes_out"] > steps * BUDGET
    # Forward and backward compute on the device; the optimizer's chunks stay in RAM and on disk.
    assert kinds_on_device == {ChunkKind.PARAM, ChunkKind.GRAD}
    manager.close()


def test_a_device_budget_below_the_working_set_names_the_minimum(tmp_path) -> None:
    # The largest module here is an attention block: its in-projection and out-projection chunks.
    with pytest.raises(BudgetError, match=r"device budget of 40000 bytes is below the working set: "
                                          r"module .* needs \d+ bytes .* minimum device budget"):
        ChunkedModel(TinyGPT(False), ChunkManager(BUDGET, DiskStore(tmp_path), device="cpu", device_budget=40_000),
                     chunk_size=CHUNK)
