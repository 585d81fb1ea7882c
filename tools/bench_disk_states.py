"""A model larger than RAM, stepped through the disk tier, with fp32, bf16 or 8-bit Adam moments (not a test).

    hatch run python tools/bench_disk_states.py [--layers 36 --d-model 2048] [--budget 2GiB] [--steps 4]
        [--states fp32,bf16,int8] [--dir /tmp] [--rounds 1]
    # the step fused into backward (no clipping) against the plain step without clipping; a bare format is
    # the plain step with clipping, "/guess" the default past RAM with clipping where it does not fire (the
    # update in backward, taken back if it clipped), "/measure" where every step clips (the norm in backward):
    hatch run python tools/bench_disk_states.py --states fp32/noclip,fp32/fused,int8/noclip,int8/fused
    # "+noevict" after the variant reads ahead into free budget only (no Belady eviction for a read ahead):
    hatch run python tools/bench_disk_states.py --states fp32/fused,fp32/fused+noevict --rounds 2
    # "+after": where every step clips, the update after backward as before (not left to the next forward):
    hatch run python tools/bench_disk_states.py --states int8/measure,int8/measure+after --steps 6
    # "torch": plain PyTorch forward + backward of the same model in RAM, the compute bound (#34's target):
    hatch run python tools/bench_disk_states.py --states torch,fp32/fused,int8/fused --rounds 2
    # bf16 compute (16-bit parameter chunks, an fp32 master; the gradient in its parameter's slot):
    hatch run python tools/bench_disk_states.py --dtype bf16 --states fp32,int8 --steps 3

Each run is a fresh process (`--one STATES` runs one and prints a JSON line): the reference GPT with
`memory.offload = "disk"` under a chunk budget, fp32 compute, micro-batch 2 x seq 128. The first step
is the warm-up that records the trace; the table gives the median of the rest: step time, bytes the
chunk manager moved between RAM and disk per step, seconds stalled on I/O (both counters are cumulative:
differences of consecutive steps), peak RSS, and the bytes of
the chunks (model states). `capstan bench-disk` on the same directory bounds what the disk allows.
With --rounds > 1 the formats alternate (fp32, bf16, fp32, ...), each round a new process. Warm-up is a
tenth of the steps (at least one), then cosine decay; every step's loss is printed after the table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

# A variant after the moments' format ("fp32/fused"): how the step runs (docs/chunkmem.md, "Past RAM").
VARIANTS = {"": ({"overlap_optimizer": False}, 1.0),  # the plain step after backward, clipping at 1.0
            "noclip": ({"overlap_optimizer": False}, 0.0),  # the same without clipping (off: on by default past RAM)
            "fused": ({"overlap_optimizer": True}, 0.0),  # each chunk group updated during backward
            # clipping on but never reached (the steady state where it is rare): each step guesses, updates
            # during backward and keeps its gradients to redo it from (the default past RAM with clipping)
            "guess": ({"overlap_optimizer": True}, 1e6),
            # every step clips: the first guess is taken back, every later step takes the norm during backward
            "measure": ({"overlap_optimizer": True}, 1e-6)}


def one(states: str, layers: int, d_model: int, budget: str, steps: int, directory: str, lr: float = 1e-4,
        prefetch: int | None = None, dtype: str = "fp32") -> dict:
    import torch

    from capstan import comm
    from capstan.comm.health.procmem import peak_rss_bytes
    from capstan.engine import initialize, open_data, train_batches

    torch.manual_seed(0)
    moments, _, variant = states.partition("/")
    variant, _, option = variant.partition("+")  # "+noevict": reads ahead into free budget only; "+after" above
    memory, clip = VARIANTS[variant]
    cfg = {"model": {"n_layers": layers, "n_heads": max(1, d_model // 128), "d_model": d_model, "seq_len": 128},
           "data": {"max_bytes": 2_000_000},
           "train": {"steps": steps, "micro_batch_size": 2, "lr": lr, "warmup_steps": max(1, steps // 10),
                     "grad_clip": clip},
           "memory": {"offload": "disk", "cpu_budget": budget, "disk_dir": directory, **memory},
           "precision": {"optimizer_states": moments, "dtype": dtype}}
    t0 = time.perf_counter()
    engine = initialize(config=cfg, groups=comm.single_process_groups())
    if prefetch is not None:  # chunks in the read-ahead's window (readahead.py)
        engine.manager.prefetch_depth = prefetch
    if option == "after" and engine.optimizer.speculation is not None:  # chunkmem's adam.py "Deferred update" off
        engine.optimizer.speculation.defers = False
    if option == "noevict":
        engine.manager.prefetch_evicts = False
    built = time.perf_counter() - t0
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    rows = []
    for _ in range(steps):
        t = time.perf_counter()
        info = engine.train_batch(it)
        rows.append({"s": time.perf_counter() - t, "moved": info.mem["mem.moved_bytes"],
                     "stall": info.mem.get("mem.stall_s", 0.0), "loss": info.loss, "norm": info.grad_norm})
    # An update a step left to the next forward (every step clipping on disk: chunkmem's "Deferred update") is
    # timed in the next step; the last step's has none after it: run here, reported apart (a run's end pays it
    # once, not every step).
    t = time.perf_counter()
    engine.states.flush_pending()
    flush_s = time.perf_counter() - t
    disk_file = engine.manager.disk.nbytes() if engine.manager.disk is not None else 0
    chunks = sum(e.chunk.nbytes for e in engine.manager.entries.values())
    by_kind: dict[str, int] = {}  # what the bytes per parameter are made of (parameter, master, gradient, moments)
    for e in engine.manager.entries.values():
        by_kind[e.chunk.kind.name.lower()] = by_kind.get(e.chunk.kind.name.lower(), 0) + e.chunk.nbytes
    from capstan.engine.config.load import reference_param_count

    params = reference_param_count(engine.config)  # (chunked parameters not in RAM are empty tensors)
    engine.close()
    return {"states": states, "params": params, "chunk_bytes": chunks, "by_kind": by_kind, "build_s": built,
            "steps": rows, "peak_rss": peak_rss_bytes(), "disk_file": disk_file, "flush_s": flush_s}


def forward_backward(layers: int, d_model: int, steps: int) -> dict:
    """The compute bound of #34's target, on the same machine in the same run: plain PyTorch forward and
    backward of the same GPT (fp32, every parameter and gradient in RAM, no optimizer, gradients kept
    and accumulated: no allocation in the loop), micro-batch 2 x 128; the median of steps 2 on."""
    import torch

    from capstan import comm
    from capstan.comm.health.procmem import peak_rss_bytes
    from capstan.engine.config.load import load_config, reference_gpt_config
    from capstan.tensorpar import build_gpt

    torch.manual_seed(0)
    cfg = load_config({"model": {"n_layers": layers, "n_heads": max(1, d_model // 128), "d_model": d_model,
                                 "seq_len": 128}})
    gpt = reference_gpt_config(cfg)
    model = build_gpt(gpt, comm.single_process_groups().tp, seed=0)
    ids = torch.randint(0, gpt.vocab_size, (2, 129))
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        model.loss(model(ids[:, :-1]), ids[:, 1:]).backward()
        times.append(time.perf_counter() - t)
    return {"fwd_bwd_s": statistics.median(times[1:] or times), "times": times, "peak_rss": peak_rss_bytes()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=36)
    ap.add_argument("--d-model", type=int, default=2048)
    ap.add_argument("--budget", default="2GiB")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--states", default="fp32,bf16")
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--skip", type=int, default=1, help="steps left out of the medians (the warm-up; 3 where every "
                                                         "step clips: steps 2 and 3 record their own traces)")
    ap.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (1e-4 steps a 1.8B model into a "
                                                             "loss spike; 1e-5 lets a 4B one's loss fall)")
    ap.add_argument("--prefetch", type=int, default=None,
                    help="chunks in the read-ahead window (default: an eighth of the budget)")
    ap.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"),
                    help="compute dtype (precision.dtype): bf16 keeps 16-bit parameter chunks and an fp32 master")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one == "torch":
        print(json.dumps(forward_backward(args.layers, args.d_model, args.steps)))
        return
    if args.one:
        print(json.dumps(one(args.one, args.layers, args.d_model, args.budget, args.steps, args.dir, args.lr,
                             args.prefetch, args.dtype)))
        return
    results: dict[str, list[dict]] = {}
    for _ in range(args.rounds):
        for states in args.states.split(","):
            chunks = tempfile.mkdtemp(prefix="capstan-disk-states-", dir=args.dir)
            try:
                out = subprocess.run([sys.executable, __file__, "--one", states, "--layers", str(args.layers),
                                      "--d-model", str(args.d_model), "--budget", args.budget,
                                      "--steps", str(args.steps), "--dir", chunks, "--lr", str(args.lr),
                                      "--dtype", args.dtype]
                                     + ([] if args.prefetch is None else ["--prefetch", str(args.prefetch)]),
                                     check=True, capture_output=True, text=True).stdout
            finally:
                shutil.rmtree(chunks, ignore_errors=True)
            results.setdefault(states, []).append(json.loads(out.strip().splitlines()[-1]))
    torch_runs = results.pop("torch", [])
    bound = statistics.median(r["fwd_bwd_s"] for r in torch_runs) if torch_runs else None
    if bound is not None:
        print(f"plain PyTorch forward + backward of the same model (all in RAM, no optimizer): {bound:.1f} s "
              f"(runs: {', '.join(' '.join(f'{t:.1f}' for t in r['times']) for r in torch_runs)}; peak RSS "
              f"{torch_runs[0]['peak_rss'] / 2**30:.1f} GiB)\n")
    first = next(iter(results.values()))[0]
    print(f"### {first['params'] / 1e9:.2f}B-parameter GPT ({args.layers} x {args.d_model}), {args.dtype} compute, "
          f"disk offload under "
          f"{args.budget}, micro-batch 2 x 128 tokens, {args.rounds} round(s), "
          f"steps {args.skip + 1}-{args.steps} of each\n")
    print("| moments | model states (chunks) | B/param | s/step | vs fp32 | vs forward + backward | moved/step | "
          "stalled on I/O | peak RSS | loss at the last step |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = None
    for states, runs in results.items():
        later = [s for r in runs for s in r["steps"][args.skip:]]
        step = statistics.median(s["s"] for s in later)
        pairs = [(a, b) for r in runs for a, b in list(zip(r["steps"], r["steps"][1:]))[args.skip - 1:]]
        moved = statistics.median(b["moved"] - a["moved"] for a, b in pairs)
        stall = statistics.median(b["stall"] - a["stall"] for a, b in pairs)
        base = base or step
        r = runs[0]
        print(f"| {states} | {r['chunk_bytes'] / 2**30:.1f} GiB | {r['chunk_bytes'] / r['params']:.1f} | {step:.1f} | "
              f"{base / step:.2f}x | {f'{step / bound:.2f}x' if bound else '-'} | {moved / 2**30:.1f} GiB | "
              f"{stall:.1f} s | {r['peak_rss'] / 2**30:.2f} GiB | "
              f"{r['steps'][-1]['loss']:.4f} |")
    for states, runs in results.items():
        for k, r in enumerate(runs):
            kinds = ", ".join(f"{kind} {b / r['params']:.2f}" for kind, b in r.get("by_kind", {}).items())
            print(f"\n{states}, round {k + 1}: built in {r['build_s']:.0f} s; bytes per parameter by kind: {kinds}; "
                  f"disk file "
                  f"{r.get('disk_file', 0) / 2**30:.1f} GiB; loss (gradient norm) by step: "
                  + ", ".join(f"{s['loss']:.3f} ({s.get('norm', 0.0):.2f})" for s in r["steps"])
                  + "; seconds by step: " + ", ".join(f"{s['s']:.1f}" for s in r["steps"])
                  + (f"; the last step's update, left to a forward that never came, {r['flush_s']:.1f} s"
                     if r.get("flush_s", 0) > 0.05 else ""))


if __name__ == "__main__":
    main()
