"""Single-process checks: identities on a group of one, the init scheme, and clear size errors.

Slicing and size checks need no communication, so a `Group` value with more
than one member (and no process group) exercises them in this process.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from capstan import comm
from capstan import tensorpar as T
from capstan.tensorpar.testing import local_part, param_errors

ONE = comm.single_process_groups().tp


def _fake_tp(n: int, rank: int) -> comm.Group:
    return comm.Group(name="tp", ranks=tuple(range(n)), rank=rank)


def test_mappings_are_identities_on_a_group_of_one() -> None:
    x = torch.randn(2, 4, 6, requires_grad=True)
    for fn in (T.copy_to_tensor_parallel_region, T.reduce_from_tensor_parallel_region,
               T.scatter_to_tensor_parallel_region, T.gather_from_tensor_parallel_region,
               T.scatter_to_sequence_parallel_region, T.gather_from_sequence_parallel_region,
               T.reduce_scatter_to_sequence_parallel_region):
        assert fn(x, ONE) is x  # no autograd node, no copy


def test_layers_on_a_group_of_one_are_the_plain_layers() -> None:
    x = torch.randn(2, 5, 8)
    col = T.ColumnParallelLinear(8, 12, ONE, seed=1, sequence_parallel=True, gather_output=True)
    assert torch.equal(col(x), F.linear(x, col.weight, col.bias))
    row = T.RowParallelLinear(8, 12, ONE, seed=2)
    assert torch.equal(row(x), F.linear(x, row.weight, row.bias))
    emb = T.VocabParallelEmbedding(10, 8, ONE, seed=3)
    ids = torch.randint(0, 10, (2, 5))
    assert torch.equal(emb(ids), F.embedding(ids, emb.weight))
    logits, target = torch.randn(3, 7), torch.randint(0, 7, (3,))
    got = T.vocab_parallel_cross_entropy(logits, target, ONE)
    assert torch.allclose(got, F.cross_entropy(logits, target, reduction="none"), rtol=1e-6, atol=0)


@pytest.mark.parametrize("n", [2, 4])
def test_sliced_gpt_parameters_are_slices_of_the_unsliced_model(n: int) -> None:
    cfg = T.GPTConfig(vocab_size=53, seq_len=8, d_model=16, n_heads=4, n_layers=2, dropout=0.0)
    full = T.build_gpt(cfg, ONE, seed=5)
    pieces = [T.build_gpt(cfg, _fake_tp(n, r), seed=5) for r in range(n)]
    for r, sliced in enumerate(pieces):
        assert max(param_errors(sliced, full, _fake_tp(n, r)).values()) == 0.0  # bit-identical slices
    # The slices tile the full weight: q/k/v rows of rank r are its heads.
    qkv = [dict(p.named_parameters())["layers.1.attn.qkv.weight"] for p in pieces]
    q_full = dict(full.named_parameters())["layers.1.attn.qkv.weight"][:16]
    assert torch.equal(torch.cat([w[: 16 // n] for w in qkv]), q_full)
    assert qkv[0].tp_dim == 0 and qkv[0].tp_fused == 3
    assert T.tp_dim_of(dict(pieces[0].named_parameters())["layers.1.ln1.weight"]) is None


@pytest.mark.parametrize("n", [1, 2])
def test_a_gpt_built_on_the_meta_device_has_the_eager_structure_and_marks(n: int) -> None:
    cfg = T.GPTConfig(vocab_size=53, seq_len=8, d_model=16, n_heads=4, n_layers=2, dropout=0.0)
    group = _fake_tp(n, n - 1)
    eager = dict(T.build_gpt(cfg, group, seed=5).named_parameters())
    with torch.device("meta"):
        meta = dict(T.build_gpt(cfg, group, seed=5).named_parameters())
    assert list(meta) == list(eager)
    for name, p in meta.items():
        assert p.is_meta and p.shape == eager[name].shape, name
        assert (T.tp_dim_of(p), getattr(p, "tp_fused", 1)) == (
            T.tp_dim_of(eager[name]), getattr(eager[name], "tp_fused", 1)
        )


def test_padded_vocab_rows_are_zero_and_tile_the_table() -> None:
    full = torch.randn(10, 4)
    parts = [T.VocabParallelEmbedding(10, 4, _fake_tp(4, r), full_weight=full).weight for r in range(4)]
    assert [p.shape[0] for p in parts] == [3, 3, 3, 3]
    assert torch.equal(torch.cat(parts)[:10], full) and not torch.cat(parts)[10:].any()
    assert torch.equal(local_part(full, parts[3], _fake_tp(4, 3)), parts[3])


def test_bad_sizes_raise_naming_the_sizes() -> None:
    tp3 = _fake_tp(3, 0)
    with pytest.raises(ValueError, match=r"n_heads \(4\) is not divisible by the tensor-parallel size \(3\)"):
        T.build_gpt(T.GPTConfig(vocab_size=10, seq_len=6, d_model=24, n_heads=4, n_layers=1, dropout=0.0), tp3, 0)
    with pytest.raises(ValueError, match=r"d_model \(30\) is not divisible by n_heads \(4\)"):
        T.ParallelSelfAttention(30, 4, ONE, T.TensorParallelRNG(ONE, 0))
    with pytest.raises(ValueError, match=r"FFN hidden size \(20\) is not divisible by the tensor-parallel size \(3\)"):
        T.ParallelMLP(6, 20, tp3)
    with pytest.raises(ValueError, match=r"output features \(10\) is not divisible .* \(3\)"):
        T.ColumnParallelLinear(6, 10, tp3)
    with pytest.raises(ValueError, match=r"input features \(10\) is not divisible .* \(3\)"):
        T.RowParallelLinear(10, 6, tp3)
    with pytest.raises(ValueError, match=r"seq_len \(sequence parallelism\) \(8\) is not divisible .* \(3\)"):
        T.build_gpt(T.GPTConfig(vocab_size=10, seq_len=8, d_model=6, n_heads=3, n_layers=1, dropout=0.0), tp3, 0,
                    sequence_parallel=True)
    with pytest.raises(ValueError, match="GPTConfig.dropout"):
        T.GPTConfig(vocab_size=10, seq_len=8, d_model=6, n_heads=3, n_layers=1, dropout=1.0)
    with pytest.raises(ValueError, match=r"token ids must be in \[0, 10\)"):
        T.VocabParallelEmbedding(10, 4, ONE)(torch.tensor([[3, 10]]))
    with pytest.raises(ValueError, match="fused"):
        T.ColumnParallelLinear(6, 18, ONE, fused=3, gather_output=True)


def test_dropout_streams_replicated_equal_sliced_differ() -> None:
    rngs = [T.TensorParallelRNG(_fake_tp(2, r), seed=11) for r in range(2)]
    x = torch.ones(1000)
    rep = [T.dropout(x, 0.5, True, g.replicated()) for g in rngs]
    sliced = [T.dropout(x, 0.5, True, g.tensor_parallel()) for g in rngs]
    assert torch.equal(rep[0], rep[1])
    assert not torch.equal(sliced[0], sliced[1])
    assert abs(sliced[0].mean().item() - 1.0) < 0.1  # inverted dropout keeps the expectation
    assert torch.equal(T.dropout(x, 0.5, False, rngs[0].replicated()), x)
