"""Adam moments in fewer bits in chunks: bf16 (half the bytes) and 8-bit (a quarter), each training as a
plain flat AdamW with the same kernel does.

`ChunkedModel(moment_dtype=torch.bfloat16)` keeps EXP_AVG and EXP_AVG_SQ chunks in bf16. Their rounding
draws its bits from each element's place in the canonical parameter order, which is independent of how
the chunks pack the parameters, so chunks in RAM, on disk, packed in module or trace order and stepped
during backward all train bit for bit as one flat buffer stepped by `kernels.adam_update`.

`moment_dtype=torch.uint8` keeps them as block-wise quantized codes (kernels.adam_update_q8) with each
chunk's block scales behind its codes. Blocks start at each parameter's first element and the rounding
draws from the canonical order too, so the same layouts (and the overlapped step rolled back when
clipping fires) train bit for bit as one flat buffer stepped with one segment per parameter.

`ChunkedModel(dtype=bf16, master_dtype=bf16)` keeps no fp32 copy of the parameters: the bf16 PARAM chunk
is the master, which the kernel steps in fp32 and stores with stochastic rounding drawn from each
element's canonical index, and the gradients keep autograd's bf16 in GRAD chunks of their own. With fp32,
bf16 or 8-bit moments the same layouts train bit for bit as one flat bf16 buffer stepped by the same
kernel; the chunks hold 2 + 2 bytes a parameter before the moments, where an fp32 master takes 2 + 4.
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


class _Net(torch.nn.Module):
    """Modules created in the reverse of the order forward calls them: packed in trace order, a chunk's
    slots then run against the canonical (creation) order."""

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


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randint(0, 64, (4, 8), generator=g)
    return x, (x * 3 + 1) % 64


def _loss(model: torch.nn.Module, step: int) -> torch.Tensor:
    x, y = _batch(step)
    return torch.nn.functional.cross_entropy(model(x).float().reshape(-1, 64), y.reshape(-1))


def _flat(moments: torch.dtype = torch.bfloat16, master: torch.dtype = torch.float32) -> list[float]:
    """The module's parameters in one flat buffer of the master's dtype (named_parameters order: the
    canonical one), their gradients in another, and one kernel call over the whole buffer per step,
    seeded by the step (8-bit moments: `adam_update_q8` with one segment per parameter): what every chunk
    layout must equal."""
    model = _net()
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params]).to(master)
    grad = torch.zeros_like(flat)
    segments, pos = [], 0
    for p in params:
        p.data = flat[pos : pos + p.numel()].view_as(p)
        p.grad = grad[pos : pos + p.numel()].view_as(p)
        segments.append((pos, p.numel(), pos))
        pos += p.numel()
    m, v = torch.zeros_like(flat, dtype=moments), torch.zeros_like(flat, dtype=moments)
    nb = kernels.q8_blocks([n for _, n, _ in segments], 256)
    sm, sv = torch.zeros(nb), torch.zeros(nb)
    out = []
    for step in range(1, STEPS + 1):
        loss = _loss(model, step)
        loss.backward()
        if moments == torch.uint8:
            kernels.adam_update_q8(flat, grad, m, v, sm, sv, step=step, seed=step, segments=segments, **HP)
        else:
            kernels.adam_update(flat, grad, m, v, step=step, seed=step, index_base=0, **HP)
        grad.zero_()
        out.append(loss.item())
    return out


def _chunked(budget: int | None = None, disk: object = None, order: str = "modules", overlap: bool = False,
             clip: float | None = None, moments: torch.dtype = torch.bfloat16,
             master: torch.dtype = torch.float32) -> tuple[list[float], ChunkedModel, ChunkAdam]:
    """Training in chunks; `master` bf16: bf16 parameters that are their own master."""
    manager = ChunkManager(budget, DiskStore(disk) if disk is not None else None, audit=True)
    example = (_batch(0)[0],) if order == "trace" else None
    model = ChunkedModel(_net(), manager, CHUNK, moment_dtype=moments, order=order, example_inputs=example,
                         report_grads=overlap, dtype=master, master_dtype=master)
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


def test_moment_chunks_are_bf16_and_half_the_bytes() -> None:
    _, model, _ = _chunked()
    for kind in ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ:
        for chunk in model.chunks[kind][0]:
            assert chunk.dtype == torch.bfloat16
            assert chunk.nbytes * 2 == model.chunks[ChunkKind.PARAM][0][0].nbytes
    assert all(c.dtype == torch.float32 for c in model.chunks[ChunkKind.PARAM][0] + model.chunks[ChunkKind.GRAD][0])
    with pytest.raises(ValueError, match="moment dtype must be float32, bfloat16 or uint8"):
        ChunkedModel(_net(), ChunkManager(None), CHUNK, moment_dtype=torch.float16)


def test_canonical_numbering_does_not_depend_on_the_packing() -> None:
    """Every element has one canonical index, the same whether chunks pack modules in module or trace
    order, and the spans of all chunks cover [0, parameters) once."""
    numbering, spans = {}, {}
    for order in ("modules", "trace"):
        _, model, _ = _chunked(order=order)
        numbering[order] = {h.name: h.canonical for h in model.homes.values()}
        spans[order] = sum(len(model.rounding_spans(0, i)) for i in range(len(model.chunks[ChunkKind.PARAM][0])))
        covered = []
        for i in range(len(model.chunks[ChunkKind.PARAM][0])):
            covered += [(base, base + hi - lo) for lo, hi, base in model.rounding_spans(0, i)]
        covered.sort()
        total = sum(p.numel() for p in _net().parameters())
        assert covered[0][0] == 0 and covered[-1][1] == total
        assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))  # no gap, no overlap
    assert numbering["modules"] == numbering["trace"]
    assert spans["trace"] > spans["modules"]  # trace order really packed the slots out of canonical order


@pytest.mark.parametrize("case", ["ram", "disk", "trace-order", "overlapped"])
def test_chunks_train_as_one_flat_buffer_bit_for_bit(tmp_path, case: str) -> None:
    want = _flat()
    kwargs = {"ram": {}, "disk": {"budget": 6 * CHUNK * 4, "disk": tmp_path}, "trace-order": {"order": "trace"},
              "overlapped": {"overlap": True}}[case]
    got, _, _ = _chunked(**kwargs)
    assert got == want


# ---- 8-bit moments ----

def _chunked_q8(**kwargs: object) -> tuple[list[float], ChunkedModel, ChunkAdam]:
    return _chunked(moments=torch.uint8, **kwargs)  # type: ignore[arg-type]


def test_moment_chunks_hold_a_quarter_of_the_bytes_and_their_scales() -> None:
    _, model, _ = _chunked_q8()
    param = model.chunks[ChunkKind.PARAM][0]
    for kind in ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ:
        for i, chunk in enumerate(model.chunks[kind][0]):
            layout = model.q8_layout(0, i)
            assert chunk.dtype == torch.uint8
            # codes: one byte per element of the parameter chunk; then 4 bytes per block of 256 of each
            # parameter; the whole rounded up to 4 KiB pages
            assert chunk.nbytes == -(-(-(-param[i].capacity // 64) * 64 + 4 * layout.blocks) // 4096) * 4096
            assert layout.blocks == kernels.q8_blocks([h.slot.numel for h in model._homes_in(param[i])], 256)
            assert layout.scale_offset >= param[i].capacity
    with pytest.raises(ValueError, match="moment dtype must be float32, bfloat16 or uint8"):
        ChunkedModel(_net(), ChunkManager(None), CHUNK, moment_dtype=torch.float16)


@pytest.mark.parametrize("case", ["ram", "disk", "trace-order", "overlapped", "overlapped-rolled-back"])
def test_q8_chunks_train_as_one_flat_buffer_bit_for_bit(tmp_path, case: str) -> None:
    clip = 0.05 if case == "overlapped-rolled-back" else None
    # clipped: against the plain (not overlapped) chunked step, whose norm adds per-chunk sums as the
    # overlapped one does (a flat buffer's one sum of squares differs in the last bits)
    want = _flat(torch.uint8) if clip is None else _chunked_q8(clip=clip)[0]
    kwargs = {"ram": {}, "disk": {"budget": 6 * CHUNK * 4, "disk": tmp_path}, "trace-order": {"order": "trace"},
              "overlapped": {"overlap": True}, "overlapped-rolled-back": {"overlap": True, "clip": clip}}[case]
    got, model, opt = _chunked_q8(**kwargs)
    assert got == want
    if case == "disk":
        assert model.manager.counters["writes"] > 0  # the moments really went through the disk
    if case.startswith("overlapped"):
        assert opt.speculation.stepped_early > 0
        # clipping every step: the first guess is rolled back, later steps measure and do not guess
        assert (opt.speculation.rollbacks > 0) == (clip is not None)


def test_q8_checkpoint_values_write_back_to_the_same_codes() -> None:
    """read_state gives each parameter's moments as exact fp32 values; write_state rounds them to nearest,
    which is the very codes and scales they came from, so a resumed run goes on bit for bit."""
    _, model, _ = _chunked_q8()
    mgr = model.manager
    before = {}
    for kind in ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ:
        for chunk in model.chunks[kind][0]:
            mgr.access(chunk.chunk_id)
            before[chunk.chunk_id] = chunk.payload.clone()
            mgr.release(chunk.chunk_id)
    for home in owned_homes(model):
        for field in ("exp_avg", "exp_avg_sq"):
            value = read_state(model, home, field)
            assert value.dtype == torch.float32 and value.shape == home.slot.shape and bool(value.any())
            write_state(model, home, field, torch.zeros_like(value))
            write_state(model, home, field, value)
    for cid, payload in before.items():
        chunk = next(c for k in (ChunkKind.EXP_AVG, ChunkKind.EXP_AVG_SQ) for c in model.chunks[k][0]
                     if c.chunk_id == cid)
        mgr.access(cid)
        assert torch.equal(chunk.payload, payload)
        mgr.release(cid)


# ---- a bf16 master ----

BF16 = torch.bfloat16
MOMENTS = {"fp32": torch.float32, "bf16": BF16, "int8": torch.uint8}


def test_a_bf16_masters_chunks_hold_no_fp32_copy() -> None:
    """PARAM and GRAD chunks are bf16 and there is no MASTER list: 2 + 2 bytes a parameter (an fp32 master
    takes 2 + 4: its gradient in the PARAM slot, the master beside it)."""
    _, model, _ = _chunked(moments=torch.uint8, master=BF16)
    assert ChunkKind.MASTER not in model.chunks and not model.mixed and model.bf16_master
    for kind in ChunkKind.PARAM, ChunkKind.GRAD:
        assert all(c.dtype == BF16 and c.nbytes == 2 * c.capacity for c in model.chunks[kind][0])
    mixed = ChunkedModel(_net(), ChunkManager(None), CHUNK, dtype=BF16, moment_dtype=torch.uint8)

    def nbytes(m: ChunkedModel) -> int:
        kinds = (ChunkKind.PARAM, ChunkKind.GRAD, ChunkKind.MASTER)
        return sum(c.nbytes for k in kinds if k in m.chunks for c in m.chunks[k][0])

    assert nbytes(model) * 3 == nbytes(mixed) * 2
    with pytest.raises(ValueError, match="a bf16 master needs bf16 parameters"):
        ChunkedModel(_net(), ChunkManager(None), CHUNK, master_dtype=BF16)


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
@pytest.mark.parametrize("case", ["ram", "disk", "trace-order", "overlapped"])
def test_a_bf16_master_trains_as_one_flat_bf16_buffer_bit_for_bit(tmp_path, moments: str, case: str) -> None:
    kwargs = {"ram": {}, "disk": {"budget": 6 * CHUNK * 4, "disk": tmp_path}, "trace-order": {"order": "trace"},
              "overlapped": {"overlap": True}}[case]
    got, model, opt = _chunked(moments=MOMENTS[moments], master=BF16, **kwargs)
    assert got == _flat(MOMENTS[moments], BF16)
    assert got[-1] < got[0]
    if case == "disk":
        assert model.manager.counters["writes"] > 0  # the master really went through the disk
    if case == "overlapped":
        assert opt.speculation.stepped_early > 0


def test_a_guess_rolled_back_restores_the_bf16_master() -> None:
    """Clipping every step: the overlapped step's first guess is rolled back to its bf16 copies and redone,
    which trains bit for bit as the plain chunked step."""
    want = _chunked(moments=torch.uint8, master=BF16, clip=0.05)[0]
    got, _, opt = _chunked(moments=torch.uint8, master=BF16, overlap=True, clip=0.05)
    assert got == want and opt.speculation.rollbacks > 0


def test_checkpoint_values_are_the_bf16_master_and_write_back() -> None:
    """read_state gives the parameter as the bf16 master holds it; writing it back (or an fp32 value,
    rounded to nearest) sets the master; state_tensors widens it to fp32 exactly."""
    _, model, _ = _chunked(master=BF16)
    home = owned_homes(model)[0]
    value = read_state(model, home, "param")
    assert value.dtype == BF16 and value.shape == home.slot.shape
    assert torch.equal(model.state_tensors()[home.name], value.float())
    write_state(model, home, "param", torch.zeros_like(value))
    assert not read_state(model, home, "param").any()
    write_state(model, home, "param", value.float())
    assert torch.equal(read_state(model, home, "param"), value)
