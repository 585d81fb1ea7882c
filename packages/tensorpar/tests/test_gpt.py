"""The reference GPT on tp = 2 and 4: end-to-end parity, sequence parallelism, padding, training, dropout.

One spawned job per tp size; tests read its table (module-scoped fixture).

Tolerances: one forward/backward is compared at 1e-6 relative (norm-wise;
reordered fp32 partial sums, see test_layers.py). Over 20 AdamW steps those
ulp-level differences feed back through the weights, and Adam divides by
sqrt(v) so tiny gradients' rounding is not damped; the architecture invariant
(docs/ARCHITECTURE.md, invariant 1) is 1e-5 relative on the loss, which is
what the training check asserts.
"""

from __future__ import annotations

import pytest
import torch

from capstan.comm.testing import run_ranks

TOL = 1e-6
TRAIN_TOL = 1e-5
STEPS = 20
B = 2


def _config(vocab: int, dropout: float = 0.0):
    from capstan.tensorpar import GPTConfig

    return GPTConfig(vocab_size=vocab, seq_len=8, d_model=32, n_heads=4, n_layers=2, dropout=dropout)


def _batch(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (B, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _end_to_end(errs: dict, tp, one) -> None:
    from capstan import tensorpar as T
    from capstan.tensorpar.testing import grad_errors, rel_err

    for vocab in (52, 51):  # 51: padded to 52 on tp = 2 and 4, unpadded at tp = 1
        cfg = _config(vocab)
        ids, tgt = _batch(cfg, 1)
        full = T.build_gpt(cfg, one, seed=3)
        ref_logits = full(ids)
        ref_loss = full.loss(ref_logits, tgt)
        ref_loss.backward()
        plain_loss = None  # the sp = False run's, which the sp = True run is checked against
        for sp in (False, True):
            tag = f"gpt_v{vocab}{'_sp' if sp else ''}"
            model = T.build_gpt(cfg, tp, seed=3, sequence_parallel=sp)
            logits = model(ids)  # [b, s, vocab_padded / tp]
            loss = model.loss(logits, tgt)
            loss.backward()
            errs[f"{tag}/loss"] = rel_err(loss, ref_loss)
            errs[f"{tag}/logits"] = rel_err(T.gather_vocab_logits(logits.detach(), tp, vocab), ref_logits)
            for k, v in grad_errors(model, full, tp).items():
                errs[f"{tag}/grad/{k}"] = v
            if sp:  # sequence parallel on == off, directly
                errs[f"{tag}/loss_vs_no_sp"] = rel_err(loss, plain_loss)
            else:
                plain_loss = loss.detach()


def _counting_batch(cfg, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows counting up from a random start modulo vocab: learnable, so the loss visibly drops."""
    starts = torch.randint(0, cfg.vocab_size, (B, 1), generator=torch.Generator().manual_seed(seed))
    tokens = (starts + torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def _train(errs: dict, tp, one) -> None:
    from capstan import tensorpar as T

    cfg = _config(51)
    models = {"tp1": T.build_gpt(cfg, one, seed=4), "tp": T.build_gpt(cfg, tp, seed=4),
              "tp_sp": T.build_gpt(cfg, tp, seed=4, sequence_parallel=True)}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01) for k, m in models.items()}
    curves: dict[str, list[float]] = {k: [] for k in models}
    for step in range(STEPS):
        ids, tgt = _counting_batch(cfg, 100 + step)
        for k, m in models.items():
            opts[k].zero_grad()
            loss = m.loss(m(ids), tgt)
            loss.backward()
            opts[k].step()
            curves[k].append(loss.item())
    for k in ("tp", "tp_sp"):
        errs[f"train_{k}/loss"] = max(abs(a - b) / abs(b) for a, b in zip(curves[k], curves["tp1"]))
    errs["train/first_last"] = (curves["tp1"][0], curves["tp1"][-1])


def _dropout_consistency(errs: dict, tp) -> None:
    """With dropout on, replicated activations stay identical across tp ranks; sliced ones get own masks."""
    from capstan import comm
    from capstan import tensorpar as T

    cfg = _config(52, dropout=0.3)
    model = T.build_gpt(cfg, tp, seed=5).train()
    ids, _ = _batch(cfg, 2)
    hidden = ids
    for layer in list(model.layers)[:-1]:  # embedding, blocks, final norm: replicated outputs
        hidden = layer(hidden)
    mine = hidden.detach().contiguous()
    every = torch.empty(tp.size * mine.numel())
    comm.all_gather(every, mine.view(-1), group=tp)
    copies = every.view(tp.size, -1)
    errs["dropout/replicated_max_diff_across_ranks"] = (copies - copies[0]).abs().max().item()
    # Attention dropout draws from the per-rank stream: its masks differ between ranks.
    draw = torch.rand(64, generator=model.rng.tensor_parallel())
    draws = torch.empty(tp.size * 64)
    comm.all_gather(draws, draw, group=tp)
    errs["dropout/sliced_distinct_ranks"] = len({tuple(d.tolist()) for d in draws.view(tp.size, -1)})
    off = T.build_gpt(cfg, tp, seed=5).eval()
    errs["dropout/changes_output"] = (off.layers[0](ids) - model.layers[0](ids)).abs().max().item()


def _gpt_checks() -> dict:
    from capstan import comm

    tp = comm.build_groups(comm.Topology(tp=comm.world().size)).tp
    one = comm.single_process_groups().tp
    errs: dict = {}
    _end_to_end(errs, tp, one)
    _dropout_consistency(errs, tp)
    _train(errs, tp, one)
    return errs


@pytest.fixture(scope="module", params=[2, 4], ids=lambda n: f"tp{n}")
def gpt_results(request) -> tuple[int, list[dict]]:
    return request.param, run_ranks(_gpt_checks, request.param, timeout=240)


def _assert_small(gpt_results, prefixes: tuple[str, ...], tol: float) -> None:
    n, per_rank = gpt_results
    seen = 0
    for rank, errs in enumerate(per_rank):
        for name, err in errs.items():
            if name.startswith(prefixes):
                seen += 1
                assert err <= tol, f"tp={n} rank {rank}: {name} relative error {err:.3e} > {tol}"
    assert seen


def test_gpt_end_to_end_equals_unsliced(gpt_results) -> None:
    _assert_small(gpt_results, ("gpt_v52/",), TOL)
    n_grads = sum(1 for k in gpt_results[1][0] if k.startswith("gpt_v52/grad/"))
    # Every parameter is compared: wte, wpe; 12 per block (2 norms, qkv, proj, fc, proj: w and b);
    # final norm w, b; head weight.
    assert n_grads == 2 + 12 * 2 + 2 + 1


def test_gpt_sequence_parallel_equals_plain(gpt_results) -> None:
    _assert_small(gpt_results, ("gpt_v52_sp/",), TOL)


def test_gpt_padded_vocab_equals_unpadded(gpt_results) -> None:
    _assert_small(gpt_results, ("gpt_v51/", "gpt_v51_sp/"), TOL)


def test_training_20_adamw_steps_matches_one_process(gpt_results) -> None:
    _assert_small(gpt_results, ("train_tp",), TRAIN_TOL)
    first, last = gpt_results[1][0]["train/first_last"]
    assert last < first  # the runs compared are actually learning


def test_dropout_masks_replicated_equal_sliced_differ(gpt_results) -> None:
    n, per_rank = gpt_results
    for errs in per_rank:
        assert errs["dropout/replicated_max_diff_across_ranks"] == 0.0
        assert errs["dropout/sliced_distinct_ranks"] == n
        assert errs["dropout/changes_output"] > 0.0


def test_build_gpt_layers_equals_the_whole_models_layers() -> None:
    # A pipeline stage builds only layers start:stop; each must equal the whole model's (per-layer seeds).
    from capstan.comm import single_process_groups
    from capstan.tensorpar import GPTConfig, build_gpt, build_gpt_layers

    cfg = GPTConfig(vocab_size=64, seq_len=8, d_model=32, n_heads=4, n_layers=3, dropout=0.0)
    tp = single_process_groups().tp
    whole = build_gpt(cfg, tp, seed=5).layers
    torch.manual_seed(123)  # the global generator must not matter
    for start, stop in ((0, 1), (2, 4), (3, None)):
        part = build_gpt_layers(cfg, tp, 5, start, stop)
        assert [type(m) for m in part] == [type(m) for m in whole[start:stop]]
        for mine, ref in zip(part, whole[start:stop], strict=True):
            for (n, a), (_, b) in zip(mine.state_dict().items(), ref.state_dict().items(), strict=True):
                assert torch.equal(a, b), n
