"""Convergence of Adam's moments stored in fewer bits (precision.optimizer_states), not a test.

    hatch run python tools/bench_optimizer_states.py [--steps 2000] [--states fp32,bf16,int8] [--seeds 1234,1235]
    # with 3 seeds or more, each format is also compared with fp32 of the same seed (paired), mean and error:
    hatch run python tools/bench_optimizer_states.py --states fp32,bf16 --seeds 1234,1235,1236,1237,1238,1239
        [--peers torch-adamw,bnb-adamw8bit,torchao-adamw8bit]

Trains the same small GPT on the default corpus once per moment format and seed, in this one process and
run: same data, schedule and layout (one process, fp32 compute, flat ZeRO-0 buffers; every layout draws
the same rounding bits, test_optimizer_states.py); train.seed changes the initialization and the batch
order. Reports, averaged over the seeds, the validation loss (held-out tokens, data.val_fraction) at the
end and the mean training loss of the last 100 steps, each format's difference from fp32 moments, and
fp32's own seed-to-seed difference (the noise a format's difference is to be read against), then the
validation curve of the first seed. Prints a markdown fragment for docs/benchmarks.md.

A format may name a bf16 master after a slash (precision.master_weights = "bf16": no fp32 copy, the bf16
parameters stepped with stochastic rounding), which needs bf16 compute (chunks or the flat buffer alike):

    hatch run python tools/bench_optimizer_states.py --dtype bf16 --offload cpu \
        --states fp32,int8,fp32/bf16-master,int8/bf16-master --seeds 1234,1235,1236,1237

Every run of one invocation then computes in that dtype on that path, the fp32-master fp32-moment run
included (the baseline each row is compared with).

--peers trains the same model (capstan's reference GPT, the same initialization, batches, learning-rate
schedule, clipping and decay groups) in a plain PyTorch loop with another optimizer: torch's AdamW (fp32
moments: the loop's own baseline), bitsandbytes' AdamW8bit and torchao's AdamW8bit (8-bit moments,
block-wise, their defaults), where they import. Their rows compare with the plain loop's fp32 AdamW.
"""

from __future__ import annotations

import argparse
import statistics
import time


def train(states: str, steps: int, eval_every: int, seed: int, dtype: str = "fp32", offload: str = "none") -> dict:
    from capstan import comm
    from capstan.engine import initialize, open_data, train_batches, val_batches

    engine = initialize(config=_config(steps, seed, states, dtype, offload), groups=comm.single_process_groups())
    data = open_data(engine.config)
    it = train_batches(data, engine.config, 1, 0)
    held = val_batches(data, engine.config, 1, 0)
    losses, times, evals = [], [], []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        losses.append(engine.train_batch(it).loss)
        times.append(time.perf_counter() - t)
        if step % eval_every == 0 or step == steps:
            evals.append((step, engine.eval_batch(held)))
    engine.close()
    return {"losses": losses, "evals": evals, "step_s": statistics.median(times[10:])}


def _config(steps: int, seed: int, states: str = "fp32", dtype: str = "fp32", offload: str = "none") -> dict:
    """`states`: the moments' format, optionally "/bf16-master" (precision.master_weights = "bf16")."""
    moments, _, master = states.partition("/")
    if master not in ("", "bf16-master"):
        raise SystemExit(f"--states {states!r}: after a slash only bf16-master")
    return {"model": {"n_layers": 4, "n_heads": 4, "d_model": 128, "seq_len": 64},
            "train": {"steps": steps, "micro_batch_size": 16, "lr": 3e-3, "min_lr": 3e-4,
                      "warmup_steps": min(100, steps // 10), "grad_clip": 1.0, "weight_decay": 0.1, "beta2": 0.999,
                      "eval_batches": 32, "seed": seed},
            "precision": {"optimizer_states": moments, "dtype": dtype,
                          "master_weights": "bf16" if master else "fp32"},
            "memory": {"offload": offload}}


def _peer_optimizer(name: str, groups: list[dict], t) -> object:  # noqa: ANN001
    """`name`'s optimizer over the decay groups, with the engine's hyper-parameters."""
    import torch

    kw = dict(lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps)
    if name == "torch-adamw":
        return torch.optim.AdamW(groups, **kw)
    if name == "bnb-adamw8bit":
        import bitsandbytes as bnb  # noqa: PLC0415 (an optional peer)
        return bnb.optim.AdamW8bit(groups, **kw)
    if name == "torchao-adamw8bit":
        from torchao.optim import AdamW8bit  # noqa: PLC0415 (an optional peer)
        return AdamW8bit(groups, **kw)
    raise ValueError(f"unknown peer {name!r}")


def train_plain(name: str, steps: int, eval_every: int, seed: int) -> dict:
    """The engine's one-process fp32 run, as a plain PyTorch loop around peer optimizer `name`."""
    import torch

    from capstan import comm
    from capstan.engine import open_data, train_batches, val_batches
    from capstan.engine.config.load import resolve
    from capstan.engine.model.models import build_reference_model
    from capstan.engine.schedule_lr import lr_at
    from capstan.engine.zero.optimizer import decays

    cfg, _ = resolve(_config(steps, seed), ())
    t = cfg.train
    torch.manual_seed(t.seed)
    model = build_reference_model(cfg, comm.single_process_groups())
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if decays(p)], "weight_decay": t.weight_decay},
              {"params": [p for p in params if not decays(p)], "weight_decay": 0.0}]
    opt = _peer_optimizer(name, groups, t)
    data = open_data(cfg)
    it = train_batches(data, cfg, 1, 0)
    held = val_batches(data, cfg, 1, 0)
    losses, times, evals = [], [], []
    for step in range(1, steps + 1):
        tick = time.perf_counter()
        for group in opt.param_groups:  # (torchao keeps lr as a tensor, to be filled)
            if isinstance(group["lr"], torch.Tensor):
                group["lr"].fill_(lr_at(t, step - 1))
            else:
                group["lr"] = lr_at(t, step - 1)
        x, y = next(it)
        loss = model.loss(model(x), y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
        times.append(time.perf_counter() - tick)
        if step % eval_every == 0 or step == steps:
            model.eval()
            with torch.no_grad():
                evals.append((step, sum(float(model.loss(model(a), b)) for a, b in held) / len(held)))
            model.train()
    return {"losses": losses, "evals": evals, "step_s": statistics.median(times[10:])}


def paired(runs: dict[str, list[dict]], seeds: list[int]) -> None:
    """Each format against fp32 moments with the same seed (the same initialization and batches: the seed's
    own noise cancels), per seed, then the mean of those differences and its standard error over seeds; and
    fp32's spread between seeds, the noise an unpaired comparison is read against."""
    def rel(a: dict, b: dict) -> tuple[float, float]:
        val = a["evals"][-1][1] / b["evals"][-1][1] - 1
        tail = statistics.fmean(a["losses"][-100:]) / statistics.fmean(b["losses"][-100:]) - 1
        return val, tail

    print(f"\n| paired with fp32, same seed | {' | '.join(f'seed {x}' for x in seeds)} | mean | standard error |")
    print("|---|" + "---|" * (len(seeds) + 2))
    for s in runs:
        if s == "fp32" or s.startswith("plain loop"):
            continue
        for k, name in ((0, "val loss at the end"), (1, "train loss, last 100 steps")):
            d = [rel(a, b)[k] for a, b in zip(runs[s], runs["fp32"])]
            se = statistics.stdev(d) / len(d) ** 0.5
            print(f"| {s}, {name} | {' | '.join(f'{x:+.2%}' for x in d)} | **{statistics.fmean(d):+.2%}** | "
                  f"{se:.2%} |")
    fp = runs["fp32"]
    for k, name in ((0, "val loss at the end"), (1, "train loss, last 100 steps")):
        ends = [r["evals"][-1][1] if k == 0 else statistics.fmean(r["losses"][-100:]) for r in fp]
        print(f"| fp32 itself, {name}: each seed vs the seeds' mean (noise) | "
              f"{' | '.join(f'{x / statistics.fmean(ends) - 1:+.2%}' for x in ends)} | | "
              f"{statistics.stdev(ends) / statistics.fmean(ends):.2%} (one seed's spread) |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--states", default="fp32,bf16,int8")
    ap.add_argument("--seeds", default="1234,1235")
    ap.add_argument("--peers", default="", help="comma-separated: torch-adamw, bnb-adamw8bit, torchao-adamw8bit")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"), help="precision.dtype of every run")
    ap.add_argument("--offload", default="none", choices=("none", "cpu"),
                    help="memory.offload of every run (cpu: chunks; none: the flat buffer, a bf16 master too)")
    args = ap.parse_args()
    seeds = [int(x) for x in args.seeds.split(",")]
    runs = {s: [train(s, args.steps, args.eval_every, seed, args.dtype, args.offload) for seed in seeds]
            for s in args.states.split(",")}
    for peer in filter(None, args.peers.split(",")):
        try:
            runs[f"plain loop, {peer}"] = [train_plain(peer, args.steps, args.eval_every, seed) for seed in seeds]
        except ImportError as exc:
            print(f"({peer} not run: {exc})")

    def val(s: str) -> float:
        return statistics.fmean(r["evals"][-1][1] for r in runs[s])

    def tail(s: str) -> float:
        return statistics.fmean(statistics.fmean(r["losses"][-100:]) for r in runs[s])

    print(f"### Adam moments in fewer bits: GPT 4 x 128, seq 64, 16 sequences a step, {args.steps} steps, "
          f"{args.dtype} compute, offload {args.offload}, mean of seeds {args.seeds}\n")
    print("| moments (capstan) or optimizer (plain loop) | val loss at the end | vs fp32 | "
          "train loss, last 100 steps | vs fp32 | s/step |")
    print("|---|---|---|---|---|---|")
    for s in runs:
        step_s = statistics.median(r["step_s"] for r in runs[s])
        base = "plain loop, torch-adamw" if s.startswith("plain loop") else "fp32"
        dv = f"{val(s) / val(base) - 1:+.2%}" if base in runs else "-"
        dt = f"{tail(s) / tail(base) - 1:+.2%}" if base in runs else "-"
        print(f"| {s} | {val(s):.4f} | {dv} | {tail(s):.4f} | {dt} | {step_s:.4f} |")
    if "fp32" in runs and len(seeds) > 1:
        a, b = runs["fp32"][0], runs["fp32"][1]
        sv = b["evals"][-1][1] / a["evals"][-1][1] - 1
        st = statistics.fmean(b["losses"][-100:]) / statistics.fmean(a["losses"][-100:]) - 1
        print(f"| fp32, seed {seeds[1]} vs seed {seeds[0]} (noise) | | {sv:+.2%} | | {st:+.2%} | |")
    if "fp32" in runs and len(seeds) > 2:
        paired(runs, seeds)
    print("\n| step | " + " | ".join(f"val loss, {s} (seed {seeds[0]})" for s in runs) + " |")
    print("|---|" + "---|" * len(runs))
    for k, (step, _) in enumerate(next(iter(runs.values()))[0]["evals"]):
        print(f"| {step} | " + " | ".join(f"{r[0]['evals'][k][1]:.4f}" for r in runs.values()) + " |")


if __name__ == "__main__":
    main()
