"""Mappings, layers, cross-entropy and one GPT block on tp = 2 and 4 against the unsliced layer.

One spawned job per tp size runs every check and returns {check: relative
error}; the tests below read that table (module-scoped fixture), so the suite
pays process start-up once per tp size.

Tolerance: 1e-6 relative (norm-wise, see `capstan.tensorpar.testing.rel_err`).
In fp32 (eps = 1.2e-7) the sliced layers do the same multiplications as the
dense ones but add partial sums in a different order (per-rank partial
matmuls then an all-reduce, a max/sum over vocabulary slices), which changes
results by a few ulps of the summed terms: well under 1e-6 at these sizes.
A slicing or communication bug (wrong head, missing all-reduce, double
counting) gives errors of order 1.
"""

from __future__ import annotations

import pytest
import torch

from capstan.comm.testing import run_ranks

TOL = 1e-6
B, S, D, HEADS = 2, 8, 32, 4
VOCAB = 51  # 52 padded at tp = 2 and 4


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _module_parity(name, make, x_full, in_view, out_view, errs, tp, one) -> None:
    """make(group) builds the layer; in_view/out_view cut a full [b, s, ..] tensor to this rank's part."""
    from capstan.tensorpar.testing import grad_errors, rel_err

    full, sliced = make(one), make(tp)
    grad = x_full.is_floating_point()
    xf = x_full.clone().requires_grad_(grad)
    xs = in_view(x_full).clone().requires_grad_(grad)
    of, os_ = full(xf), sliced(xs)
    w = _rand(*of.shape, seed=7)  # a non-trivial upstream gradient
    (of * w).sum().backward()
    (os_ * out_view(w)).sum().backward()
    errs[f"{name}/out"] = rel_err(os_, out_view(of))
    if grad:
        errs[f"{name}/dx"] = rel_err(xs.grad, in_view(xf.grad))
    for k, v in grad_errors(sliced, full, tp).items():
        errs[f"{name}/grad/{k}"] = v


def _mapping_checks(errs: dict, tp) -> None:
    from capstan import tensorpar as T
    from capstan.tensorpar.testing import rel_err

    n, r = tp.size, tp.rank
    xs = [_rand(B, S, D, seed=100 + i) for i in range(n)]  # every rank's input, known to all
    ws = [_rand(B, S, D, seed=200 + i) for i in range(n)]  # every rank's upstream gradient

    def run(fn, x, w):
        x = x.clone().requires_grad_()
        y = fn(x)
        (y * w).sum().backward()
        return y, x.grad

    y, g = run(lambda x: T.copy_to_tensor_parallel_region(x, tp), xs[0], ws[r])
    errs["f/out"], errs["f/grad"] = rel_err(y, xs[0]), rel_err(g, sum(ws))
    y, g = run(lambda x: T.reduce_from_tensor_parallel_region(x, tp), xs[r], ws[r])
    errs["g/out"], errs["g/grad"] = rel_err(y, sum(xs)), rel_err(g, ws[r])
    for dim, tag in ((-1, "tp"), (1, "seq")):
        scatter = T.scatter_to_tensor_parallel_region if tag == "tp" else T.scatter_to_sequence_parallel_region
        y, g = run(lambda x: scatter(x, tp, dim), xs[0], ws[r].chunk(n, dim)[r])
        errs[f"scatter_{tag}/out"] = rel_err(y, xs[0].chunk(n, dim)[r])
        errs[f"scatter_{tag}/grad"] = rel_err(g, torch.cat([w.chunk(n, dim)[i] for i, w in enumerate(ws)], dim))
    y, g = run(lambda x: T.gather_from_tensor_parallel_region(x, tp), xs[r], torch.cat(ws, -1))
    errs["gather_tp/out"], errs["gather_tp/grad"] = rel_err(y, torch.cat(xs, -1)), rel_err(g, ws[r])
    y, g = run(lambda x: T.gather_from_sequence_parallel_region(x, tp), xs[r], torch.cat(ws, 1).roll(r, 0))
    want = sum(torch.cat(ws, 1).roll(i, 0) for i in range(n)).chunk(n, 1)[r]  # partial grads, summed
    errs["gather_seq/out"], errs["gather_seq/grad"] = rel_err(y, torch.cat(xs, 1)), rel_err(g, want)
    y, g = run(lambda x: T.reduce_scatter_to_sequence_parallel_region(x, tp), xs[r], ws[r].chunk(n, 1)[0])
    errs["reduce_scatter_seq/out"] = rel_err(y, sum(xs).chunk(n, 1)[r])
    errs["reduce_scatter_seq/grad"] = rel_err(g, torch.cat([w.chunk(n, 1)[0] for w in ws], 1))


def _cross_entropy_checks(errs: dict, tp) -> None:
    import torch.nn.functional as F

    from capstan import tensorpar as T
    from capstan.tensorpar.testing import rel_err

    n, r = tp.size, tp.rank
    logits = _rand(B, S, VOCAB, seed=300) * 3
    target = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(301))
    target[0, 0] = VOCAB - 1  # the last real column sits next to the padding
    padded = torch.cat([logits, torch.full((B, S, 52 - VOCAB), 100.0)], -1)  # junk that must be masked
    per = 52 // n
    local = padded[..., r * per : (r + 1) * per].clone().requires_grad_()
    full = logits.clone().requires_grad_()
    ref = F.cross_entropy(full.reshape(-1, VOCAB), target.reshape(-1), reduction="none").view(B, S)
    got = T.vocab_parallel_cross_entropy(local, target, tp, vocab_size=VOCAB)
    w = _rand(B, S, seed=302)
    (ref * w).sum().backward()
    (got * w).sum().backward()
    errs["cross_entropy/loss"] = rel_err(got, ref)
    want_grad = torch.cat([full.grad, torch.zeros(B, S, 52 - VOCAB)], -1)[..., r * per : (r + 1) * per]
    errs["cross_entropy/grad"] = rel_err(local.grad, want_grad)
    errs["cross_entropy/gathered_logits"] = rel_err(T.gather_vocab_logits(local.detach(), tp, VOCAB), logits)


def _layer_checks() -> dict[str, float]:
    from capstan import comm
    from capstan import tensorpar as T

    tp = comm.build_groups(comm.Topology(tp=comm.world().size)).tp
    one = comm.single_process_groups().tp
    n, r = tp.size, tp.rank
    errs: dict[str, float] = {}
    _mapping_checks(errs, tp)
    _cross_entropy_checks(errs, tp)

    full_x = _rand(B, S, D, seed=1)
    same = lambda t: t  # noqa: E731 - replicated tensor: every rank holds all of it
    last = lambda t: t.chunk(n, -1)[r]  # noqa: E731 - split hidden features
    seq = lambda t: t.chunk(n, 1)[r]  # noqa: E731 - split tokens (sequence parallelism)
    for sp, io in ((False, same), (True, seq)):
        tag = "_sp" if sp else ""
        _module_parity(f"column{tag}", lambda g: T.ColumnParallelLinear(D, 4 * D, g, sequence_parallel=sp, seed=3),
                       full_x, io, last, errs, tp, one)
        _module_parity(f"column_gather{tag}", lambda g: T.ColumnParallelLinear(
            D, 3 * D - 2, g, gather_output=True, pad_output=True, sequence_parallel=sp, seed=4),
            full_x, io, same, errs, tp, one)
        _module_parity(f"column_qkv{tag}", lambda g: T.ColumnParallelLinear(
            D, 3 * D, g, fused=3, sequence_parallel=sp, seed=5),
            full_x, io, lambda t: torch.cat([b.chunk(n, -1)[r] for b in t.chunk(3, -1)], -1), errs, tp, one)
        _module_parity(f"row{tag}", lambda g: T.RowParallelLinear(D, D, g, sequence_parallel=sp, seed=6),
                       full_x, last, io, errs, tp, one)
        ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(8))
        _module_parity(f"embedding{tag}", lambda g: T.VocabParallelEmbedding(VOCAB, D, g, sequence_parallel=sp,
                                                                           seed=9), ids, same, io, errs, tp, one)
        _module_parity(f"layernorm{tag}", lambda g: T.ParallelLayerNorm(D, g, sequence_parallel=sp),
                       full_x, io, io, errs, tp, one)
        _module_parity(f"rmsnorm{tag}", lambda g: T.ParallelRMSNorm(D, g, sequence_parallel=sp),
                       full_x, io, io, errs, tp, one)

        def make_block(g, sp=sp):
            return T.ParallelBlock(D, HEADS, g, T.TensorParallelRNG(g, 0), sequence_parallel=sp, seed=10,
                                   n_layers=2)
        _module_parity(f"block{tag}", make_block, full_x, io, io, errs, tp, one)
    _module_parity("row_scatter", lambda g: T.RowParallelLinear(D, D, g, input_is_parallel=False, seed=11),
                   full_x, same, same, errs, tp, one)
    _module_parity("mlp", lambda g: T.ParallelMLP(D, 4 * D, g, seed=12), full_x, same, same, errs, tp, one)
    _module_parity("attention", lambda g: T.ParallelSelfAttention(D, HEADS, g, T.TensorParallelRNG(g, 0), seed=13),
                   full_x, same, same, errs, tp, one)
    return errs


def _comm_volume() -> dict[str, dict[str, int]]:
    """What one block's forward + backward sends, with and without sequence parallelism."""
    from capstan import comm
    from capstan import tensorpar as T

    tp = comm.build_groups(comm.Topology(tp=comm.world().size)).tp
    out = {}
    for sp in (False, True):
        block = T.ParallelBlock(D, HEADS, tp, T.TensorParallelRNG(tp, 0), sequence_parallel=sp, seed=10)
        x = _rand(B, S // tp.size if sp else S, D, seed=1).requires_grad_()
        with T.count_comm() as c:
            block(x).sum().backward()
        out["sp" if sp else "plain"] = {
            **{f"calls/{k}": v for k, v in c.calls.items()},
            **{f"payload/{k}": v for k, v in c.payload_bytes.items()},
            "wire": c.total_wire_bytes,
        }
    return out


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"tp{n}")
def layer_errors(request) -> tuple[int, list[dict[str, float]]]:
    return request.param, run_ranks(_layer_checks, request.param, timeout=240)


def _assert_small(layer_errors, prefixes: tuple[str, ...]) -> None:
    n, per_rank = layer_errors
    seen = 0
    for rank, errs in enumerate(per_rank):
        for name, err in errs.items():
            if name.startswith(prefixes):
                seen += 1
                assert err <= TOL, f"tp={n} rank {rank}: {name} relative error {err:.3e} > {TOL}"
    assert seen, f"no checks named {prefixes}"


def test_mappings_forward_and_backward(layer_errors) -> None:
    _assert_small(layer_errors, ("f/", "g/", "scatter_", "gather_", "reduce_scatter_"))


def test_vocab_parallel_cross_entropy_with_padded_vocab(layer_errors) -> None:
    _assert_small(layer_errors, ("cross_entropy/",))


def test_linear_layers(layer_errors) -> None:
    _assert_small(layer_errors, ("column", "row"))


def test_embedding_with_padded_vocab(layer_errors) -> None:
    _assert_small(layer_errors, ("embedding",))


def test_layernorm_replicated_grads_with_sequence_parallel(layer_errors) -> None:
    _assert_small(layer_errors, ("layernorm",))


def test_attention_mlp_and_block(layer_errors) -> None:
    _assert_small(layer_errors, ("attention", "mlp", "block"))


def test_every_layer_parameter_checked(layer_errors) -> None:
    _, per_rank = layer_errors
    names = set(per_rank[0])
    # Replicated parameters under sequence parallelism: these need the tp all-reduce of their grads.
    for want in ("layernorm_sp/grad/weight", "row_sp/grad/bias", "block_sp/grad/ln1.bias",
                 "block_sp/grad/attn.proj.bias", "block_sp/grad/mlp.proj.bias", "block/grad/attn.qkv.weight"):
        assert want in names


@pytest.mark.parametrize("n", [2])
def test_block_communication_volume(n: int) -> None:
    plain, sp = run_ranks(_comm_volume, n, timeout=120)[0].values()
    act = B * S * D * 4  # bytes of one full activation [b, s, d] in fp32
    # Megatron section 3: 2 all-reduces forward (after attn.proj, after mlp.proj) + 2 backward (the f's).
    assert plain == {"calls/all_reduce": 4, "payload/all_reduce": 4 * act, "wire": 4 * act * 2 * (n - 1) // n}
    # Sequence parallelism (Korthikanti et al. 4.2.2): each all-reduce becomes all-gather + reduce-scatter,
    # plus the tp all-reduce of the replicated parameters' grads (2 norms x (w, b) + 2 row biases, d each).
    param_ar = 6 * D * 4
    assert sp["calls/all_gather"] == 4 and sp["calls/reduce_scatter"] == 4
    assert sp["payload/all_gather"] == 4 * act and sp["payload/reduce_scatter"] == 4 * act
    assert sp["calls/all_reduce"] == 6 and sp["payload/all_reduce"] == param_ar
    assert sp["wire"] - param_ar * 2 * (n - 1) // n == plain["wire"]
