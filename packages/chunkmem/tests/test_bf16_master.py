"""A bf16 master in chunks (`ChunkedModel(dtype=bf16, master_dtype=bf16)`): no fp32 copy of the parameters.

The PARAM chunk is the master: the optimizer steps it in fp32 and stores it with stochastic rounding drawn
from each element's canonical index (kernels.adam_update with a bf16 param), and the gradients keep
autograd's bf16 in GRAD chunks of their own. With fp32, bf16 or 8-bit moments, chunks in RAM, on disk,
packed in trace order and stepped during backward (rolled back where clipping fires) train bit for bit as
one flat bf16 buffer stepped by the same kernel; the chunks hold 2 + 2 bytes a parameter before the
moments, where an fp32 master takes 2 + 4.
"""

from __future__ import annotations

import pytest
import torch

from capstan.chunkmem import ChunkAdam, ChunkedModel, ChunkKind, ChunkManager, DiskStore
from capstan.chunkmem.model.state_io import owned_homes, read_state, write_state
from capstan.native import kernels

CHUNK = 4096
STEPS = 8
HP = dict(lr=1e-2, weight_decay=0.1)
BF16 = torch.bfloat16
MOMENTS = {"fp32": torch.float32, "bf16": BF16, "int8": torch.uint8}


class _Net(torch.nn.Module):
    """Modules created in the reverse of the order forward calls them: packed in trace order, a chunk's
    slots run against the canonical (creation) order."""

    def __init__(self) -> None:
        super().__init__()
        self.head, self.norm = torch.nn.Linear(32, 64), torch.nn.LayerNorm(32)
        self.down, self.up, self.embed = torch.nn.Linear(128, 32), torch.nn.Linear(32, 128), torch.nn.Embedding(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        return self.head(self.norm(h + self.down(torch.nn.functional.gelu(self.up(h)))))


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return _Net()


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (4, 8), generator=g)
    return torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 64), ((x * 3 + 1) % 64).reshape(-1))


def _flat_reference(moments: str) -> list[float]:
    """The parameters in one flat bf16 buffer (named_parameters order: the canonical one), their bf16
    gradients in another, and one kernel call over the whole buffer per step, seeded by the step (8-bit
    moments: one segment per parameter): what every chunk layout must equal."""
    model = _net()
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to(BF16)
    grad = torch.zeros_like(flat)
    segments, pos = [], 0
    for p in params:
        p.data = flat[pos : pos + p.numel()].view_as(p)
        p.grad = grad[pos : pos + p.numel()].view_as(p)
        segments.append((pos, p.numel(), pos))
        pos += p.numel()
    m, v = torch.zeros_like(flat, dtype=MOMENTS[moments]), torch.zeros_like(flat, dtype=MOMENTS[moments])
    nb = kernels.q8_blocks([n for _, n, _ in segments], 256)
    sm, sv = torch.zeros(nb), torch.zeros(nb)
    out = []
    for step in range(1, STEPS + 1):
        loss = _loss(model, step)
        loss.backward()
        if moments == "int8":
            kernels.adam_update_q8(flat, grad, m, v, sm, sv, step=step, seed=step, segments=segments, **HP)
        else:
            kernels.adam_update(flat, grad, m, v, step=step, seed=step, index_base=0, **HP)
        grad.zero_()
        out.append(loss.item())
    return out


def _chunked(moments: str, budget: int | None = None, disk: object = None, order: str = "modules",
             overlap: bool = False, clip: float | None = None) -> tuple[list[float], ChunkedModel, ChunkAdam]:
    manager = ChunkManager(budget, DiskStore(disk) if disk is not None else None, audit=True)
    example = (torch.zeros(4, 8, dtype=torch.long),) if order == "trace" else None
    model = ChunkedModel(_net(), manager, CHUNK, dtype=BF16, master_dtype=BF16, moment_dtype=MOMENTS[moments],
                         order=order, example_inputs=example, report_grads=overlap)
    opt = ChunkAdam(model, overlap=overlap, **HP)
    out = []
    for step in range(1, STEPS + 1):
        manager.begin_step()
        if overlap:
            opt.arm(grad_clip=clip)
        loss = _loss(model, step)
        model.backward(loss)
        opt.step(grad_clip=clip)
        manager.end_step()
        out.append(loss.item())
    return out, model, opt


def test_the_chunks_hold_no_fp32_copy() -> None:
    """PARAM and GRAD chunks are bf16 and there is no MASTER list: 2 + 2 bytes a parameter (an fp32 master
    takes 2 + 4: its gradient in the PARAM slot, the master beside it)."""
    _, model, _ = _chunked("int8")
    assert ChunkKind.MASTER not in model.chunks and not model.mixed and model.bf16_master
    for kind in ChunkKind.PARAM, ChunkKind.GRAD:
        assert all(c.dtype == BF16 and c.nbytes == 2 * c.capacity for c in model.chunks[kind][0])
    mixed = ChunkedModel(_net(), ChunkManager(None), CHUNK, dtype=BF16, moment_dtype=torch.uint8)

    def nbytes(m: ChunkedModel, kinds: tuple[ChunkKind, ...]) -> int:
        return sum(c.nbytes for k in kinds if k in m.chunks for c in m.chunks[k][0])

    ours = nbytes(model, (ChunkKind.PARAM, ChunkKind.GRAD, ChunkKind.MASTER))
    assert ours * 3 == nbytes(mixed, (ChunkKind.PARAM, ChunkKind.GRAD, ChunkKind.MASTER)) * 2
    with pytest.raises(ValueError, match="a bf16 master needs bf16 parameters"):
        ChunkedModel(_net(), ChunkManager(None), CHUNK, master_dtype=BF16)


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("case", ["ram", "disk", "trace-order", "overlapped"])
def test_chunks_train_as_one_flat_bf16_buffer_bit_for_bit(tmp_path, moments: str, case: str) -> None:
    kwargs = {"ram": {}, "disk": {"budget": 6 * CHUNK * 4, "disk": tmp_path}, "trace-order": {"order": "trace"},
              "overlapped": {"overlap": True}}[case]
    got, model, opt = _chunked(moments, **kwargs)
    assert got == _flat_reference(moments)
    assert got[-1] < got[0]
    if case == "disk":
        assert model.manager.counters["writes"] > 0  # the master really went through the disk
    if case == "overlapped":
        assert opt.speculation.stepped_early > 0


def test_a_guess_rolled_back_restores_the_bf16_master() -> None:
    """Clipping every step: the overlapped step's first guess is rolled back to its bf16 copies and redone,
    which trains bit for bit as the plain chunked step."""
    want = _chunked("int8", clip=0.05)[0]
    got, _, opt = _chunked("int8", overlap=True, clip=0.05)
    assert got == want and opt.speculation.rollbacks > 0


def test_checkpoint_values_are_the_bf16_master_and_write_back() -> None:
    """read_state gives the parameter as the bf16 master holds it; writing it back (or an fp32 value,
    rounded to nearest) sets the master, which the module then computes with."""
    _, model, _ = _chunked("bf16")
    home = owned_homes(model)[0]
    value = read_state(model, home, "param")
    assert value.dtype == BF16 and value.shape == home.slot.shape
    write_state(model, home, "param", torch.zeros_like(value))
    assert not read_state(model, home, "param").any()
    write_state(model, home, "param", value.float())
    assert torch.equal(read_state(model, home, "param"), value)
