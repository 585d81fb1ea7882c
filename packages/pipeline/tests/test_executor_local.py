"""The executor in one process (groups of one, every collective an identity), and the header codec.

A single stage runs every schedule's instruction stream through the same
handlers as a multi-stage job; with one stage the tied embedding and head
share one Parameter, so gradients must equal the plain model's exactly.
"""

from __future__ import annotations

import pytest
import torch

from capstan import comm
from capstan.pipeline import (
    PipelineError,
    PipelineExecutor,
    build_layers,
    make_schedule,
    partition,
    tie_layers,
)
from capstan.pipeline.runtime.transport import decode_header, encode_header, shape_key
from capstan.pipeline.testing_models import gpt_loss, gpt_specs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("checkpoint", [False, True])
def test_one_stage_equals_the_plain_model(schedule: str, tied: bool, checkpoint: bool) -> None:
    specs = gpt_specs(vocab=32, hidden=16, layers=2, heads=2, seq=6, tied=tied)
    ex = PipelineExecutor(
        partition(specs, 1),
        make_schedule(schedule, 1, 3),
        comm.single_process_groups(),
        gpt_loss,
        seed=1,
        checkpoint=checkpoint,
    )
    g = torch.Generator().manual_seed(0)
    xs = [torch.randint(0, 32, (2, 6), generator=g) for _ in range(3)]
    ys = [torch.randint(0, 32, (2, 6), generator=g) for _ in range(3)]
    loss = ex.step(xs, ys)

    layers = build_layers(specs, range(len(specs)), seed=1)
    tie_layers(specs, layers)
    model = torch.nn.Sequential(*layers)
    want = 0.0
    for x, y in zip(xs, ys, strict=True):
        part = gpt_loss(model(x), y) / 3
        part.backward()
        want += float(part.detach())
    assert loss == pytest.approx(want, rel=1e-6)
    got = dict(ex.chunks[0].named_parameters(remove_duplicate=False))
    for name, p in model.named_parameters(remove_duplicate=False):
        # Same kernels, same order, one process: bitwise equal.
        assert torch.equal(got[name].grad, p.grad), name
    if tied:
        assert ex.chunks[0][0].weight is ex.chunks[0][len(specs) - 1].weight


def test_a_stage_built_on_meta_has_the_structure_without_values() -> None:
    # For chunked memory: the caller materializes the parameters (straight into chunks).
    specs = gpt_specs(vocab=32, hidden=16, layers=2, heads=2, seq=6)
    args = (make_schedule("1f1b", 1, 2), comm.single_process_groups(), gpt_loss)
    real = PipelineExecutor(partition(specs, 1), *args, seed=1)
    meta = PipelineExecutor(partition(specs, 1), *args, seed=1, meta=True)
    shapes = {n: p.shape for n, p in real.chunks.named_parameters()}
    assert {n: p.shape for n, p in meta.chunks.named_parameters()} == shapes
    assert all(p.is_meta for p in meta.chunks.parameters())
    tied = gpt_specs(vocab=32, hidden=16, layers=2, heads=2, seq=6, tied=True)
    with pytest.raises(ValueError, match="meta=True with weights tied across layers"):
        PipelineExecutor(partition(tied, 1), *args, meta=True)


def test_missing_data_and_layer_errors_name_the_stage() -> None:
    specs = gpt_specs(vocab=32, hidden=16, layers=1, heads=2, seq=6)
    ex = PipelineExecutor(
        partition(specs, 1), make_schedule("1f1b", 1, 2), comm.single_process_groups(), gpt_loss
    )
    with pytest.raises(ValueError, match="stage 0 needs 2 microbatch inputs, got 1"):
        ex.step([torch.zeros(1, 6, dtype=torch.long)], [torch.zeros(1, 6, dtype=torch.long)] * 2)
    bad = [torch.full((1, 6), 99, dtype=torch.long)] * 2  # token ids outside the vocabulary
    with pytest.raises(PipelineError, match=r"pipeline stage 0 failed at Forward\(mb=0, chunk=0\)"):
        ex.step(bad, bad)
    one = comm.single_process_groups()
    with pytest.raises(ValueError, match="schedule has 2 stages but the pipeline group has 1"):
        PipelineExecutor(partition(specs, 2), make_schedule("1f1b", 2, 2), one, gpt_loss)
    with pytest.raises(ValueError, match="partition has 2 parts; .* needs stages x chunks = 1"):
        PipelineExecutor(partition(specs, 2), make_schedule("1f1b", 1, 2), one, gpt_loss)


def test_header_round_trip_and_shape_key() -> None:
    for t in (
        torch.zeros(2, 3, 4),
        torch.zeros(5, dtype=torch.long),
        torch.zeros((), dtype=torch.bfloat16),
    ):
        assert decode_header(encode_header(t)) == (tuple(t.shape), t.dtype)
    with pytest.raises(TypeError, match="complex64"):
        encode_header(torch.zeros(2, dtype=torch.complex64))
    a = [torch.zeros(2, 8, dtype=torch.long)] * 4
    assert shape_key(a) == shape_key([t.clone() for t in a])
    assert shape_key(a) != shape_key([torch.zeros(2, 6, dtype=torch.long)] * 4)
    assert shape_key(a) != shape_key(a[:3])
