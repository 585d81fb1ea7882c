"""Context parallelism (tensorpar/context.py): a sequence split over cp ranks computes what one process does.

One spawned job per cp size (2 and 4 ranks) runs every check; tests read its table. Each compares
with the whole sequence in one process: attention's output and its q, k, v gradients (random data),
the reference GPT's loss and every parameter's gradient (averaged over the cp ranks, as the engine's
dp x cp reduction does), and 20 AdamW steps. Both modes, and at 4 ranks tp 2 x cp 2 with and without
sequence parallelism, and with the tiled loss and MLP (tiled_loss.py) under cp and tp 2 x cp 2 + sp.
Tolerances as test_gpt.py: 1e-6 norm-wise for one pass (the online softmax and the split matmuls reorder
fp32 sums), 1e-5 on the loss over 20 steps.
"""

from __future__ import annotations

import pytest
import torch

from capstan.comm import Group
from capstan.comm.testing import run_ranks
from capstan.native import standin
from capstan.tensorpar.context import ContextParallel, check_context_sizes, cp_positions

TOL = 1e-6
TRAIN_TOL = 1e-5


def test_positions_shard_and_gather_round_trip() -> None:
    assert cp_positions(0, 2, 4, "ulysses") == [0, 1, 2, 3] and cp_positions(1, 2, 4, "ulysses") == [4, 5, 6, 7]
    # ring: 2 cp chunks of 2; rank r holds chunks r and 2cp-1-r
    assert cp_positions(0, 2, 4, "ring") == [0, 1, 6, 7] and cp_positions(1, 2, 4, "ring") == [2, 3, 4, 5]
    x = torch.arange(2 * 16).view(2, 16)
    for mode in ("ulysses", "ring"):
        parts = [ContextParallel(Group("cp", (0, 1, 2, 3), r), mode).shard(x) for r in range(4)]
        assert all(p.shape == (2, 4) for p in parts)
        assert torch.equal(ContextParallel(Group("cp", (0, 1, 2, 3), 0), mode).gather(parts), x)
        assert sorted(sum((cp_positions(r, 4, 4, mode) for r in range(4)), [])) == list(range(16))


@standin.requires()
def test_positions_on_a_device_are_made_once() -> None:
    """The GPT's forward and the sharding of its inputs and targets ask for this rank's positions every
    micro-batch; made from a Python list on an accelerator each would be a blocking copy (the host waiting
    for the device): they are made once per size and device, so asking again makes the host wait for
    nothing, and the tokens are the same."""
    device = torch.device(standin.load(), 0)
    cp = ContextParallel(Group("cp", (0, 1), 1), "ring")
    first = cp.positions(4, device)
    before = standin.host_syncs()
    assert cp.positions(4, device) is first and standin.host_syncs() == before
    x = torch.arange(16, device=device).view(2, 8)
    mine = cp.shard(x)
    assert standin.host_syncs() == before and mine.cpu().tolist() == [[2, 3, 4, 5], [10, 11, 12, 13]]
    assert cp.positions(4).device.type == "cpu" and cp.positions(2, device) is not first


@pytest.mark.parametrize(("seq", "heads", "cp", "mode", "message"), [
    (12, 4, 4, "ring", "ring attention needs the sequence (12 tokens) to divide by 2 x cp = 8"),
    (12, 4, 5, "ulysses", "Ulysses attention needs the sequence (12 tokens) to divide by cp = 5"),
    (16, 6, 4, "ulysses", "attention heads per tensor-parallel rank (6) to divide by cp = 4"),
    (16, 4, 2, "zigzag", "cp mode 'zigzag': expected one of ulysses, ring"),
])
def test_sizes_that_do_not_split_are_named(seq: int, heads: int, cp: int, mode: str, message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_context_sizes(seq, heads, cp, mode)


def _attention(errs: dict, cp_group: Group, mode: str) -> None:
    import torch.nn.functional as F

    from capstan.tensorpar.testing import rel_err

    cp = ContextParallel(cp_group, mode)
    g = torch.Generator().manual_seed(7)
    b, h, s, d = 2, 4, 16, 8
    q, k, v, w = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64).float() for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    y = F.scaled_dot_product_attention(*ref, is_causal=True)
    (y * w).sum().backward()
    mine = [cp.shard(t, 2).clone().requires_grad_() for t in (q, k, v)]
    out = cp.attention(*mine)
    (out * cp.shard(w, 2)).sum().backward()
    errs[f"{mode}/attn/out"] = rel_err(out, cp.shard(y, 2))
    for name, got, want in zip("qkv", mine, ref):
        errs[f"{mode}/attn/d{name}"] = rel_err(got.grad, cp.shard(want.grad, 2))


def _ring_tiles(errs: dict, cp_group: Group) -> None:
    """Ring attention in tiles smaller than a chunk (5 of 12 or 6 tokens: partial tiles, masked and
    skipped ones on the diagonal) against the fused kernel on the whole sequence."""
    import torch.nn.functional as F

    from capstan.tensorpar.testing import rel_err

    cp = ContextParallel(cp_group, "ring", ring_tile=5)
    g = torch.Generator().manual_seed(11)
    b, h, s, d = 1, 2, 48, 8
    q, k, v, w = (torch.randn(b, h, s, d, generator=g, dtype=torch.float64).float() for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    (F.scaled_dot_product_attention(*ref, is_causal=True) * w).sum().backward()
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    mine = [cp.shard(t, 2).clone().requires_grad_() for t in (q, k, v)]
    out = cp.attention(*mine)
    (out * cp.shard(w, 2)).sum().backward()
    errs["ring/tiles/out"] = rel_err(out, cp.shard(y, 2))
    for name, got, want in zip("qkv", mine, ref):
        errs[f"ring/tiles/d{name}"] = rel_err(got.grad, cp.shard(want.grad, 2))


def _gpt(errs: dict, tp: Group, cp_group: Group, mode: str, tag: str, sp: bool = False, tiled: bool = False) -> None:
    from capstan import comm
    from capstan import tensorpar as T
    from capstan.tensorpar.modules.gpt import loss_targets
    from capstan.tensorpar.testing import grad_errors, rel_err

    cfg = T.GPTConfig(vocab_size=52, seq_len=16, d_model=32, n_heads=4, n_layers=2, dropout=0.0)
    tiles = T.GPTConfig(**{**cfg.__dict__, "loss_tile": 3, "mlp_tile": 2}) if tiled else cfg
    one = comm.single_process_groups().tp
    cp = ContextParallel(cp_group, mode)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.seq_len + 1), generator=g)
    ids, tgt = tokens[:, :-1], tokens[:, 1:]
    full = T.build_gpt(cfg, one, seed=3)
    ref_loss = full.loss(full(ids), tgt)
    ref_loss.backward()
    model = T.build_gpt(tiles, tp, seed=3, sequence_parallel=sp, cp=cp)
    with loss_targets(cp.shard(tgt) if tiled else None):
        out = model(cp.shard(ids))
    loss = model.loss(out, cp.shard(tgt))
    loss.backward()
    mean = loss.detach().clone()
    comm.all_reduce(mean, "avg", group=cp_group)
    for p in model.parameters():  # what the dp x cp gradient reduction does
        comm.all_reduce(p.grad, "avg", group=cp_group)
    errs[f"{tag}/loss"] = rel_err(mean, ref_loss)
    for k, e in grad_errors(model, full, tp).items():
        errs[f"{tag}/grad/{k}"] = e


def _train(errs: dict, cp_group: Group, mode: str) -> None:
    from capstan import comm
    from capstan import tensorpar as T

    cfg = T.GPTConfig(vocab_size=51, seq_len=16, d_model=32, n_heads=4, n_layers=2, dropout=0.0)
    one = comm.single_process_groups().tp
    cp = ContextParallel(cp_group, mode)
    models = {"one": T.build_gpt(cfg, one, seed=4), "cp": T.build_gpt(cfg, one, seed=4, cp=cp)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for k, m in models.items()}
    curves: dict[str, list[float]] = {k: [] for k in models}
    for step in range(20):
        starts = torch.randint(0, cfg.vocab_size, (2, 1), generator=torch.Generator().manual_seed(100 + step))
        tokens = (starts + torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
        ids, tgt = tokens[:, :-1], tokens[:, 1:]
        for k, m in models.items():
            opts[k].zero_grad()
            if k == "cp":
                loss = m.loss(m(cp.shard(ids)), cp.shard(tgt))
                loss.backward()
                for p in m.parameters():
                    comm.all_reduce(p.grad, "avg", group=cp_group)
                loss = loss.detach().clone()
                comm.all_reduce(loss, "avg", group=cp_group)
            else:
                loss = m.loss(m(ids), tgt)
                loss.backward()
            opts[k].step()
            curves[k].append(loss.item())
    errs[f"{mode}/train/loss"] = max(abs(a - b) / abs(b) for a, b in zip(curves["cp"], curves["one"]))
    errs[f"{mode}/train/first_last"] = (curves["one"][0], curves["one"][-1])


def _checks() -> dict:
    from capstan import comm

    n = comm.world().size
    errs: dict = {}
    cp_only = comm.build_groups(comm.Topology(cp=n))
    _ring_tiles(errs, cp_only.cp)
    for mode in ("ulysses", "ring"):
        _attention(errs, cp_only.cp, mode)
        _gpt(errs, cp_only.tp, cp_only.cp, mode, f"{mode}/gpt")
        _gpt(errs, cp_only.tp, cp_only.cp, mode, f"{mode}/tiled", tiled=True)  # tiled loss and MLP too
        _train(errs, cp_only.cp, mode)
    if n == 4:  # tp 2 x cp 2 (ranks 0,1 one tp group), with and without sequence parallelism
        both = comm.build_groups(comm.Topology(tp=2, cp=2))
        for mode in ("ulysses", "ring"):
            _gpt(errs, both.tp, both.cp, mode, f"{mode}/tp2cp2")
            _gpt(errs, both.tp, both.cp, mode, f"{mode}/tp2cp2sp", sp=True)
            _gpt(errs, both.tp, both.cp, mode, f"{mode}/tp2cp2tiled", sp=True, tiled=True)
    return errs


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"cp{n}")
def results(request) -> tuple[int, list[dict]]:
    return request.param, run_ranks(_checks, request.param, timeout=300)


def _assert_small(results: tuple[int, list[dict]], part: str, tol: float) -> int:
    n, per_rank = results
    seen = 0
    for rank, errs in enumerate(per_rank):
        for name, err in errs.items():
            if part in name and not name.endswith("first_last"):
                seen += 1
                assert err <= tol, f"cp={n} rank {rank}: {name} relative error {err:.3e} > {tol}"
    return seen


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_attention_output_and_gradients_equal_one_process(results, mode: str) -> None:
    assert _assert_small(results, f"{mode}/attn/", TOL) == 4 * results[0]


def test_ring_attention_in_tiles_smaller_than_a_chunk_equals_one_process(results) -> None:
    assert _assert_small(results, "ring/tiles/", TOL) == 4 * results[0]


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_gpt_loss_and_every_gradient_equal_one_process(results, mode: str) -> None:
    # wte, wpe; 12 per block; final norm w, b; head: 29 gradients and the loss, on every rank
    assert _assert_small(results, f"{mode}/gpt/", TOL) == 30 * results[0]


@pytest.mark.parametrize("results", [4], indirect=True, ids=["cp4"])  # the 2-rank job has no room for tp 2 x cp 2
@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_tp_and_cp_together_equal_one_process(results, mode: str) -> None:
    """tp 2 x cp 2 (plain, sequence-parallel, tiled) from the 4-rank job: 30 values per case on each rank."""
    assert results[0] == 4
    assert _assert_small(results, f"{mode}/tp2cp2", TOL) == 3 * 30 * 4


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_tiled_loss_and_mlp_under_cp_equal_one_process(results, mode: str) -> None:
    assert _assert_small(results, f"{mode}/tiled/", TOL) == 30 * results[0]


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_twenty_adamw_steps_follow_one_process(results, mode: str) -> None:
    assert _assert_small(results, f"{mode}/train/", TRAIN_TOL) == results[0]
    first, last = results[1][0][f"{mode}/train/first_last"]
    assert last < first
