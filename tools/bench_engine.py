"""End-to-end training throughput of capstan.engine against plain PyTorch, DDP, FSDP2 (and DeepSpeed).

From a clean checkout (the hatch env pins torch 2.13.0 CPU):

    hatch run python tools/bench_engine.py                 # everything below, ~15 min on 2 busy cores
    hatch run python tools/bench_engine.py --only single   # capstan vs a plain PyTorch loop
    hatch run python tools/bench_engine.py --only dp2      # capstan dp=2 ZeRO-2 vs DDP vs FSDP2 (gloo)
    hatch run python tools/bench_engine.py --layers 2 --d-model 128 --seq 64 --steps 2 --rounds 2   # smoke test
    # optional DeepSpeed peers (ZeRO-2 / ZeRO-3, offload_optimizer cpu), from a separate throwaway venv:
    python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install torch==2.13.0 deepspeed
    hatch run python tools/bench_engine.py --deepspeed /tmp/dsvenv/bin/python

Every system trains the same model: capstan's reference GPT
(`capstan.tensorpar.build_gpt`, default 6 layers, d_model 512, 8 heads, seq
256, byte vocabulary, dropout 0, seed 1234: 19.2M parameters), on the same
batches (random bytes from a generator seeded by the step; 4 sequences per
rank per step), fp32, AdamW (lr 1e-3, betas 0.9/0.95, weight decay 0.1 on
matrices only), gradient clipping at 1.0, one thread per rank. The peers:

* single: a plain PyTorch loop, `torch.optim.AdamW(fused=True)` and
  `clip_grad_norm_` (what capstan's engine does, written by hand);
* dp2: `DistributedDataParallel` (fused AdamW) and FSDP2 (`fully_shard` per
  layer + root on a 2-rank CPU mesh; ``fsdp2-noreshard`` with ``reshard_after_forward=False``, FSDP2's
  ZeRO-2), both over gloo, against capstan
  `parallel.zero_stage = 2` over gloo (gradient buckets communicating during
  backward; add ``capstan-after`` to --systems-dp2 for the same engine with
  ``parallel.bucket_mb = 0``, all communication after backward, or
  ``capstan-gather-off`` for the parameter all-gather after the step in one
  blocking call instead of buckets waited for by the next forward); with --deepspeed also DeepSpeed
  ZeRO-2 and ZeRO-3 with `offload_optimizer: cpu` (DS_ACCELERATOR=cpu, gloo).

Two measurements (launched with `capstan.comm.testing.run_ranks`):

1. interleaved (tokens/s): all systems live in the same process(es); each of
   `--rounds` rounds runs `--steps` timed steps of every system back to back,
   the order alternating by round, so each round's capstan/peer ratio is
   paired over the same few seconds of machine load. Medians and per-round
   ratios are printed.
2. processes (peak RSS): each (system, round) is a fresh set of processes, so
   `ru_maxrss` is that system's alone; tokens/s is printed too (noisier:
   the systems run minutes apart). DeepSpeed runs only here (its own venv;
   tools/bench_engine_deepspeed.py).

tokens/s counts every rank's tokens over the timed steps (after `--warmup`
untimed ones), divided by the slowest rank's wall time.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import torch

VOCAB = 256  # the default vocabulary (bytes); --vocab 8192 gives the issue's 27.4M-parameter GPT
CHUNK = 1 << 20  # chunk elements for the capstan-z3-* systems (4 MiB fp32 chunks; more if a tensor is larger)
DISK_RUN_BUDGET_MIB = 96  # RAM for chunks in capstan-z3-disk: ~65% of a rank's 154 MB of fp32 states (19.3M GPT)


def model_config(a: dict) -> dict:
    return {"model": {"n_layers": a["layers"], "n_heads": a["heads"], "d_model": a["d_model"],
                      "seq_len": a["seq"], "vocab_size": a.get("vocab", VOCAB), "dropout": 0.0},
            "train": {"micro_batch_size": a["micro"], "grad_accum_steps": 1, "steps": 1_000_000,
                      "lr": 1e-3, "weight_decay": 0.1, "grad_clip": 1.0, "warmup_steps": 0,
                      "lr_schedule": "constant"},
            "parallel": {"zero_stage": a.get("zero_stage", 0), "bucket_mb": a.get("bucket_mb", 25.0),
                         "zero2_collective": a.get("zero2_collective", "all_reduce"),
                         "overlap_param_gather": a.get("overlap_param_gather")},
            "memory": a.get("memory", {})}


def batches(micro: int, seq: int, rank: int, world: int, vocab: int = VOCAB):
    """Step k's global batch is micro*world sequences from generator seed k; rank r takes its slice."""
    k = 0
    while True:
        g = torch.Generator().manual_seed(k)
        x = torch.randint(0, vocab, (micro * world, seq + 1), generator=g)[rank * micro:(rank + 1) * micro]
        yield x[:, :-1].contiguous(), x[:, 1:].contiguous()
        k += 1


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def plain_model(a: dict):
    from capstan import comm
    from capstan.engine.config.load import resolve
    from capstan.engine.model.models import build_reference_model

    cfg, _ = resolve(model_config(a), ())
    torch.manual_seed(cfg.train.seed)
    return cfg, build_reference_model(cfg, comm.single_process_groups())  # tp group of one: the full model


def adamw(params, cfg, **kw) -> torch.optim.Optimizer:
    t = cfg.train
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t.weight_decay},
                              {"params": rest, "weight_decay": 0.0}],
                             lr=t.lr, betas=(t.beta1, t.beta2), eps=t.eps, **kw)


def make_system(system: str, a: dict, world: int, rank: int):
    """(step function, losses list, parameter count, note) of one system on this rank."""
    import torch.distributed as dist

    note = ""
    data = batches(a["micro"], a["seq"], rank, world, a.get("vocab", VOCAB))
    losses: list[float] = []

    if system.startswith("capstan"):
        from capstan.engine.build import initialize

        # capstan-after: bucket_mb = 0, every collective after backward (the engine before the overlap);
        # capstan-rs / capstan-ar: ZeRO 2's buckets reduce-scattered / all-reduced;
        # capstan-gather-off: the parameter all-gather after the step in one blocking call;
        # capstan-z1: ZeRO 1 (what ZeRO 2's packed buckets save against).
        chunk = max(CHUNK, a.get("vocab", VOCAB) * a["d_model"])  # at least the embedding matrix
        variant = {"capstan-after": {"bucket_mb": 0.0}, "capstan-rs": {"zero2_collective": "reduce_scatter"},
                   "capstan-ar": {"zero2_collective": "all_reduce"},
                   "capstan-z1": {"zero_stage": 1},  # the whole flat gradient on every rank, moments sharded
                   "capstan-gather-off": {"overlap_param_gather": False},
                   # ZeRO-3 through chunks (chunkmem): all states in RAM, or a RAM budget with the rest on disk.
                   "capstan-z3-cpu": {"zero_stage": 3, "memory": {"offload": "cpu", "chunk_size": chunk}},
                   "capstan-z3-disk": {"zero_stage": 3, "memory": {
                       "offload": "disk", "chunk_size": chunk,
                       "cpu_budget": a.get("disk_budget_mib", DISK_RUN_BUDGET_MIB) << 20,
                       "disk_dir": os.path.join(tempfile.gettempdir(), f"bench-engine-chunks-{os.getpid()}")}},
                   }.get(system, {})
        engine = initialize(config=model_config(dict(a, **variant)))
        n_params = sum(p.numel() for p in engine.module.parameters()) if engine.chunked else engine.optimizer.numel
        from capstan import comm

        note = f"capstan.comm over {comm.backend()}" if a.get("mpirun") else ""

        def step() -> None:
            losses.append(engine.train_batch(data).loss)
    else:
        cfg, model = plain_model(a)
        n_params = sum(p.numel() for p in model.parameters())
        loss_of = model.loss
        if system == "torch":
            opt = adamw(list(model.parameters()), cfg, fused=True)
        elif system == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model)
            opt = adamw(list(model.parameters()), cfg, fused=True)
        elif system in ("fsdp2", "fsdp2-noreshard"):
            from torch.distributed.device_mesh import init_device_mesh
            from torch.distributed.fsdp import fully_shard

            # fsdp2: the default, parameters resharded after forward (ZeRO-3's memory, a second gather in
            # backward); fsdp2-noreshard: reshard_after_forward=False, parameters kept whole from forward
            # through backward (ZeRO-2's memory and traffic: the FSDP2 peer of capstan's zero_stage 2)
            mesh = init_device_mesh("cpu", (world,))
            keep = {"reshard_after_forward": system == "fsdp2"}
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, **keep)
            fully_shard(model, mesh=mesh, **keep)
            opt = adamw(list(model.parameters()), cfg, fused=True)  # tried by the first step below
        else:
            raise ValueError(system)
        clip = cfg.train.grad_clip

        def step() -> None:
            x, y = next(data)
            loss = loss_of(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
            opt.zero_grad(set_to_none=False)
            v = loss.detach().clone()
            if world > 1:
                dist.all_reduce(v)
                v /= world
            losses.append(float(v))

        if system.startswith("fsdp2"):  # fall back to foreach if fused AdamW rejects DTensors
            try:
                step()
            except Exception as e:  # noqa: BLE001
                note = f"fused AdamW failed on DTensors ({type(e).__name__}), foreach AdamW"
                opt = adamw(list(model.parameters()), cfg, foreach=True)
                losses.clear()
                data = batches(a["micro"], a["seq"], rank, world, a.get("vocab", VOCAB))
                step()
    return step, losses, n_params, note


def worker(system: str, a: dict) -> dict:
    """One system's run on this rank: `warmup` untimed steps, then `steps` timed ones."""
    torch.set_num_threads(1)

    # Set by run_ranks, or by mpirun (capstan starts its own comm from them).
    world = int(os.environ.get("WORLD_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    rank = int(os.environ.get("RANK", os.environ.get("OMPI_COMM_WORLD_RANK", "0")))
    step, losses, n_params, note = make_system(system, a, world, rank)
    return {**timed_steps(step, a, world), "losses": losses, "params": n_params, "note": note}


def timed_steps(step, a: dict, world: int) -> dict:
    """`a["warmup"]` untimed steps, a barrier, then `a["steps"]` timed ones: elapsed, per-step times, peak RSS."""
    import torch.distributed as dist

    for _ in range(max(a["warmup"], 0)):
        step()
    if world > 1:
        dist.barrier()
    t0 = time.perf_counter()
    times = []
    for _ in range(a["steps"]):
        s = time.perf_counter()
        step()
        times.append(time.perf_counter() - s)
    return {"elapsed": time.perf_counter() - t0, "step_s": times, "rss": peak_rss()}


def interleaved_worker(systems: list[str], a: dict, rounds: int) -> dict:
    """All `systems` in this process; each round runs `steps` timed steps of each, in alternating order."""
    torch.set_num_threads(1)
    import torch.distributed as dist

    from capstan import comm

    if comm.is_initialized():  # also under mpirun, which sets no WORLD_SIZE/RANK
        world, rank = comm.world().size, comm.world().rank
    else:
        world, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    built = {s: make_system(s, a, world, rank) for s in systems}
    for s in systems:
        for _ in range(a["warmup"]):
            built[s][0]()
    elapsed: dict[str, list[float]] = {s: [] for s in systems}
    for r in range(rounds):
        for s in (systems if r % 2 == 0 else systems[::-1]):
            if world > 1:
                dist.barrier()
            t0 = time.perf_counter()
            for _ in range(a["steps"]):
                built[s][0]()
            elapsed[s].append(time.perf_counter() - t0)
    return {"elapsed": elapsed, "losses": {s: built[s][1] for s in systems},
            "params": built[systems[0]][2], "notes": {s: built[s][3] for s in systems}}


def bench_interleaved(name: str, world: int, systems: list[str], a: dict, rounds: int) -> dict:
    """Throughput with every system in the same processes, alternating blocks of steps (paired by round)."""
    from capstan.comm.testing import run_mpirun, run_ranks

    a = dict(a, zero_stage=2 if world > 1 else 0)
    timeout = 300 + 60 * rounds * len(systems) * a["steps"]
    if a.get("mpirun") and world > 1:
        # capstan.comm picks MPI (shared-memory collectives) under mpirun; torch.distributed's world
        # group, which DDP and FSDP2 use, is gloo either way.
        res = run_mpirun(interleaved_worker, world, systems, a, rounds, timeout=timeout, comm_timeout=300,
                         backend=a.get("capstan_backend"), env={"CAPSTAN_LOG_LEVEL": "WARNING"})
    else:
        res = run_ranks(interleaved_worker, world, systems, a, rounds, init=world > 1, backend="gloo",
                        timeout=timeout, comm_timeout=300, env={"CAPSTAN_LOG_LEVEL": "WARNING"})
    tokens = a["steps"] * a["micro"] * a["seq"] * world
    tok = {s: [tokens / max(r["elapsed"][s][i] for r in res) for i in range(rounds)] for s in systems}
    base = systems[0]
    out: dict = {"params": res[0]["params"], "systems": {}}
    for s in systems:
        d = {"tok_s": tok[s], "median_tok_s": statistics.median(tok[s]), "note": res[0]["notes"][s],
             "losses_equal_to_first": res[0]["losses"][s][:3]}
        if s != base:
            ratios = [c / p for c, p in zip(tok[base], tok[s])]
            d["paired_ratio_capstan_over"] = ratios
            d["median_paired_ratio"] = statistics.median(ratios)
        out["systems"][s] = d
        print(f"[{name} interleaved] {s:8s} tok/s per round {', '.join(f'{x:.0f}' for x in tok[s])}"
              + (f" | capstan/{s} per round {', '.join(f'{x:.3f}' for x in d['paired_ratio_capstan_over'])}"
                 f" median {d['median_paired_ratio']:.3f}" if s != base else "")
              + (f" ({d['note']})" if d["note"] else ""), flush=True)
    return out


def run(system: str, world: int, a: dict) -> dict:
    from capstan.comm.testing import run_ranks

    timeout = 120 + 60 * (a["steps"] + a["warmup"])
    if system.startswith("ds-zero"):
        from bench_engine_deepspeed import run_deepspeed

        stage = int(system[len("ds-zero")])  # ds-zero2, ds-zero3: offload_optimizer cpu; -nooffload: none
        res = run_deepspeed(a["deepspeed"], stage, world, dict(a, ds_offload=not system.endswith("-nooffload")))
    elif system.startswith("capstan") and world > 1 and a.get("mpirun"):
        from capstan.comm.testing import run_mpirun

        backend = {"CAPSTAN_COMM_BACKEND": a["capstan_backend"]} if a.get("capstan_backend") else {}
        res = run_mpirun(worker, world, system, a, init=False, timeout=timeout, comm_timeout=300,
                         env={"CAPSTAN_LOG_LEVEL": "WARNING", **backend})
    elif system.startswith("capstan") and world > 1:
        res = run_ranks(worker, world, system, a, init=False, timeout=timeout, comm_timeout=300,
                        env={"CAPSTAN_COMM_BACKEND": "gloo", "CAPSTAN_LOG_LEVEL": "WARNING"})
    else:
        res = run_ranks(worker, world, system, a, init=world > 1, backend="gloo", timeout=timeout,
                        comm_timeout=300)
    elapsed = max(r["elapsed"] for r in res)
    tokens = a["steps"] * a["micro"] * a["seq"] * world
    return {"tok_s": tokens / elapsed, "rss": [r["rss"] for r in res], "losses": res[0]["losses"],
            "params": res[0]["params"], "step_s": statistics.median(res[0]["step_s"]), "note": res[0].get("note", "")}


def bench(name: str, world: int, systems: list[str], a: dict, rounds: int) -> dict:
    out: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(rounds):
        order = systems if r % 2 == 0 else systems[::-1]  # alternate who goes first
        for s in order:
            res = run(s, world, dict(a, zero_stage=2 if world > 1 else 0))
            out[s].append(res)
            print(f"[{name}] round {r + 1}/{rounds} {s:8s} {res['tok_s']:8.0f} tok/s  "
                  f"step {res['step_s']:.3f} s  peak RSS/rank "
                  f"{', '.join(f'{x / 2**20:.0f}' for x in res['rss'])} MiB  "
                  f"loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f}"
                  + (f" ({res['note']})" if res["note"] and r == 0 else ""), flush=True)
    base = systems[0]
    summary: dict = {"params": out[base][0]["params"], "systems": {}}
    for s in systems:
        toks = [x["tok_s"] for x in out[s]]
        rss = [max(x["rss"]) for x in out[s]]
        summary["systems"][s] = {"tok_s": toks, "median_tok_s": statistics.median(toks),
                                 "peak_rss_mib": statistics.median(rss) / 2**20,
                                 "first_losses": out[s][0]["losses"][:3]}
        if s != base:
            ratios = [c["tok_s"] / p["tok_s"] for c, p in zip(out[base], out[s])]
            summary["systems"][s]["paired_ratio_capstan_over"] = ratios
            summary["systems"][s]["median_paired_ratio"] = statistics.median(ratios)
    return summary


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=("single", "dp2", "dp2-processes"), default=None)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--disk-budget-mib", type=int, default=DISK_RUN_BUDGET_MIB,
                   help="capstan-z3-disk's RAM budget for chunks (the 27.4M GPT at --vocab 8192 needs at least 131)")
    p.add_argument("--vocab", type=int, default=VOCAB,
                   help="vocabulary size (256: bytes, 19.3M parameters; 8192: the 27.4M GPT the issue names)")
    p.add_argument("--micro", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=5, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (systems in one process)")
    p.add_argument("--process-rounds", type=int, default=2,
                   help="rounds of fresh processes per system (peak RSS; 0 skips)")
    p.add_argument("--systems-dp2", default="capstan,ddp,fsdp2")
    p.add_argument("--mpirun", action="store_true",
                   help="launch dp2 ranks with mpirun (bound to cores): capstan communicates over MPI, "
                        "DDP/FSDP2/DeepSpeed over gloo")
    p.add_argument("--capstan-backend", default=None, choices=("gloo", "mpi"),
                   help="with --mpirun: capstan.comm's backend (default: MPI when mpi4py imports)")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--deepspeed", default=None, metavar="PYTHON",
                   help="a python with deepspeed (a separate venv): adds --ds-systems to the process rounds")
    p.add_argument("--ds-systems", default="ds-zero2,ds-zero3",
                   help="DeepSpeed systems: ds-zero2 / ds-zero3 with offload_optimizer cpu, "
                        "ds-zero2-nooffload / ds-zero3-nooffload without")
    args = p.parse_args()
    a = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq, "vocab": args.vocab,
         "micro": args.micro, "steps": args.steps, "warmup": args.warmup, "deepspeed": args.deepspeed,
         "mpirun": args.mpirun, "capstan_backend": args.capstan_backend, "disk_budget_mib": args.disk_budget_mib}
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, model {a}", flush=True)
    results = {}
    if args.only in (None, "single"):
        results["single"] = bench_interleaved("single", 1, ["capstan", "torch"], a, args.rounds)
    if args.only in (None, "dp2"):
        results["dp2"] = bench_interleaved("dp2", 2, args.systems_dp2.split(","), a, args.rounds)
    if args.only in (None, "dp2", "dp2-processes") and args.process_rounds:
        systems = args.systems_dp2.split(",") + (args.ds_systems.split(",") if args.deepspeed else [])
        results["dp2_processes"] = bench("dp2 processes", 2, systems, a, args.process_rounds)
    print(json.dumps(results, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
