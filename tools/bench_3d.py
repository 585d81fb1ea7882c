"""Tokens/s of the reference GPT under each single parallel axis on 2 ranks, capstan vs PyTorch's equivalent.

From a clean checkout (the hatch env pins torch 2.13.0 CPU):

    hatch run python tools/bench_3d.py                     # dp, tp, pp; default sizes, 3 rounds
    hatch run python tools/bench_3d.py --axes tp --rounds 5
    hatch run python tools/bench_3d.py --smoke             # tiny model, 2 rounds, checks first-step losses agree

Layouts (dp, tp, pp) = (2,1,1), (1,2,1), (1,1,2), each against its PyTorch peer:

* (2,1,1): capstan `parallel.dp = 2` (`--zero-stage`, default 0) vs
  `DistributedDataParallel` + fused `torch.optim.AdamW` + `clip_grad_norm_`;
* (1,2,1): capstan `parallel.tp = 2` (Megatron slicing of every block, the
  vocabulary-parallel embedding, head and cross-entropy) vs
  `torch.distributed.tensor.parallel.parallelize_module` on a 1-D
  DeviceMesh("cpu", [0, 1]): ColwiseParallel on q, k, v and fc, RowwiseParallel
  on the attention output and MLP projections, the token embedding
  RowwiseParallel (vocabulary split, as torchtitan does) and the head
  ColwiseParallel with replicated (gathered) logits; fused AdamW over the
  DTensor parameters and another over the replicated plain ones (positions, norms),
  gradient norm from the local shards plus one all-reduce;
* (1,1,2): capstan `parallel.pp = 2`, schedule 1f1b, `--microbatches`
  micro-batches (grad_accum_steps) vs `torch.distributed.pipelining`
  (`PipelineStage` per rank, manual split at capstan's own layer boundaries,
  `Schedule1F1B`, same number of microbatches), fused AdamW per stage and a
  global gradient norm (one all-reduce of the squared norms).

Every system trains the same model from the same initial values (the peers'
plain-torch GPT copies capstan's tp=1 reference GPT, `capstan.tensorpar.build_gpt`,
seed 1234), on the same batches (step k's global batch of `--batch` sequences is
random bytes from a generator seeded by k), fp32, AdamW lr 1e-3 betas 0.9/0.95
weight decay 0.1 on matrices, gradient clipping at 1.0, one thread per rank. The
global batch is the same for all layouts: dp ranks take half each, tp ranks all
of it, pp splits it into micro-batches.

All six systems run in ONE launch of 2 ranks (`capstan.comm.testing.run_ranks`,
gloo; with `--mpirun`, `run_mpirun`: ranks bound to cores, capstan on its MPI
backend, the peers on torch's gloo groups); per axis, after `--warmup` untimed steps of each, every one of `--rounds`
rounds runs `--steps` timed steps of capstan and of the peer back to back (the
order alternating by round, a barrier before each block). tokens/s = global
tokens of the block / the slowest rank's time. Per-round ratios
capstan/peer and medians are printed, then a JSON summary.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run_ranks workers load this file by path
from bench_tensorpar import DenseBlock  # noqa: E402

VOCAB = 256
AXES = {"dp": (2, 1, 1), "tp": (1, 2, 1), "pp": (1, 1, 2)}
PEER_NAME = {"dp": "DDP", "tp": "parallelize_module", "pp": "torch.distributed.pipelining"}


# ---- the plain PyTorch GPT (same math and layer list as capstan's reference GPT) -------------------------


class Embedding(nn.Module):
    def __init__(self, d: int, seq: int) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, d)
        self.wpe = nn.Parameter(torch.zeros(seq, d))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [b, s] -> [b, s, d]
        return self.wte(ids) + self.wpe[: ids.shape[1]]


# The same plain block bench_tensorpar.py slices with parallelize_module (q, k, v separate, so
# ColwiseParallel splits whole heads; the -1 in its view is the local head count).
Block = DenseBlock


def torch_gpt(a: dict) -> nn.Sequential:
    """[embedding, blocks..., final LayerNorm, head] with the values of capstan's tp=1 reference GPT."""
    from capstan import comm
    from capstan.engine.config.load import resolve
    from capstan.engine.model.models import build_reference_model

    cfg, _ = resolve(capstan_config(a, "dp"), ())
    ref = build_reference_model(cfg, comm.single_process_groups()).layers  # tp group of one: the full model
    d = a["d_model"]
    layers: list[nn.Module] = [Embedding(d, a["seq"])]
    layers += [Block(d, a["heads"]) for _ in range(a["layers"])]
    layers += [nn.LayerNorm(d), nn.Linear(d, VOCAB, bias=False)]
    with torch.no_grad():
        layers[0].wte.weight.copy_(ref[0].wte.weight[:VOCAB])
        layers[0].wpe.copy_(ref[0].wpe)
        for mine, theirs in zip(layers[1:-2], ref[1:-2]):
            for n in ("ln1", "ln2"):
                getattr(mine, n).load_state_dict(getattr(theirs, n).state_dict())
            for i, m in enumerate((mine.q, mine.k, mine.v)):  # qkv rows are [q; k; v] at tp=1
                m.weight.copy_(theirs.attn.qkv.weight[i * d:(i + 1) * d])
                m.bias.copy_(theirs.attn.qkv.bias[i * d:(i + 1) * d])
            for m, t in ((mine.o, theirs.attn.proj), (mine.fc, theirs.mlp.fc), (mine.proj, theirs.mlp.proj)):
                m.weight.copy_(t.weight)
                m.bias.copy_(t.bias)
        layers[-2].load_state_dict(ref[-2].state_dict())
        layers[-1].weight.copy_(ref[-1].weight[:VOCAB])
    return nn.Sequential(*layers)


def lm_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


# ---- configuration and data ---------------------------------------------------------------------------------


def capstan_config(a: dict, axis: str) -> dict:
    dp, tp, pp = AXES[axis]
    mb = a["microbatches"] if pp > 1 else 1
    return {"model": {"n_layers": a["layers"], "n_heads": a["heads"], "d_model": a["d_model"],
                      "seq_len": a["seq"], "vocab_size": VOCAB, "dropout": 0.0},
            "train": {"micro_batch_size": a["batch"] // dp // mb, "grad_accum_steps": mb, "steps": 1_000_000,
                      "lr": 1e-3, "weight_decay": 0.1, "grad_clip": 1.0, "warmup_steps": 0,
                      "lr_schedule": "constant"},
            "parallel": {"dp": dp, "tp": tp, "pp": pp, "zero_stage": a["zero_stage"] if dp > 1 else 0,
                         "schedule": "1f1b"}}


def global_batches(a: dict):
    """Step k's global batch: `batch` sequences of seq+1 random bytes from generator seed k."""
    k = 0
    while True:
        x = torch.randint(0, VOCAB, (a["batch"], a["seq"] + 1), generator=torch.Generator().manual_seed(k))
        yield x[:, :-1].contiguous(), x[:, 1:].contiguous()
        k += 1


def capstan_micro_batches(a: dict, axis: str, rank: int):
    """What `engine.train_batch` reads on this rank: dp slices the batch, tp takes it whole, pp splits it."""
    dp, _, pp = AXES[axis]
    for x, y in global_batches(a):
        if dp > 1:
            n = a["batch"] // dp
            yield x[rank * n:(rank + 1) * n], y[rank * n:(rank + 1) * n]
        elif pp > 1:
            yield from zip(x.chunk(a["microbatches"]), y.chunk(a["microbatches"]))
        else:
            yield x, y


def adamw(params: list[nn.Parameter], **kw) -> torch.optim.Optimizer:
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                             lr=1e-3, betas=(0.9, 0.95), eps=1e-8, **kw)


@torch.no_grad()
def clip_(params: list[nn.Parameter], max_norm: float, sharded_sum_group=None) -> None:
    """Scale grads to a global norm <= max_norm; squares of sharded (DTensor Shard / pipeline-stage)
    grads are summed over `sharded_sum_group` with one all-reduce, replicated ones counted once."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    sharded, replicated = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    grads = []
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            local = g.to_local()
            if any(pl.is_shard() for pl in g.placements):
                sharded += local.double().pow(2).sum()
            else:
                replicated += local.double().pow(2).sum()
            grads.append(local)
        else:
            (replicated if sharded_sum_group is None else sharded).add_(g.double().pow(2).sum())
            grads.append(g)
    dist.all_reduce(sharded, group=sharded_sum_group)
    coef = min(1.0, max_norm / (math.sqrt(float(sharded + replicated)) + 1e-6))
    if coef < 1.0:
        torch._foreach_mul_(grads, coef)


# ---- the systems ----------------------------------------------------------------------------------------


def make_capstan(a: dict, axis: str, rank: int):
    from capstan.engine.build import initialize

    engine = initialize(config=capstan_config(a, axis))
    data = capstan_micro_batches(a, axis, rank)
    losses: list[float] = []

    def step() -> None:
        losses.append(engine.train_batch(data).loss)

    return step, losses, engine


def make_peer(a: dict, axis: str, rank: int, world: int):
    import torch.distributed as dist

    torch.manual_seed(0)
    model = torch_gpt(a)
    data = global_batches(a)
    losses: list[float] = []
    note = ""
    if axis == "dp":
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model)
        opt = adamw(list(ddp.parameters()), fused=True)
        n = a["batch"] // world

        def step() -> None:
            x, y = next(data)
            loss = lm_loss(ddp(x[rank * n:(rank + 1) * n]), y[rank * n:(rank + 1) * n])
            loss.backward()
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=False)
            v = loss.detach().clone()
            dist.all_reduce(v)
            losses.append(float(v) / world)

        return step, losses, note, ddp
    if axis == "tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import DTensor, Replicate
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = init_device_mesh("cpu", (world,))
        plan: dict = {"0.wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
                      f"{len(model) - 1}": ColwiseParallel(output_layouts=Replicate())}
        for i in range(1, len(model) - 2):
            plan.update({f"{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc")})
            plan.update({f"{i}.{n}": RowwiseParallel() for n in ("o", "proj")})
        model = parallelize_module(model, mesh, plan)
        params = list(model.parameters())
        dparams = [p for p in params if isinstance(p, DTensor)]
        plain = [p for p in params if not isinstance(p, DTensor)]
        # One optimizer cannot mix DTensor and plain tensors: torch 2.13 raises "aten._fused_adamw_
        # (_foreach_mul_, _foreach_norm for clip_grad_norm_) got mixed torch.Tensor and DTensor".
        opts = [adamw(dparams, fused=True), adamw(plain, fused=True)]
        note = f"{len(dparams)} DTensor params + {len(plain)} replicated plain, fused AdamW each"

        def step() -> None:
            x, y = next(data)
            loss = lm_loss(model(x), y)  # noqa: F821 (bound above; ruff reads the `del model` below as unbinding it)
            loss.backward()
            clip_(params, 1.0)
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=False)
            losses.append(float(loss))

        return step, losses, note, model
    # pp: the same layer boundaries as capstan's engine (partition by parameter count)
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from capstan.engine.config.load import resolve
    from capstan.engine.model.pipe import balanced_bounds

    cfg, _ = resolve(capstan_config(a, axis), ())
    bounds = balanced_bounds(cfg, world)
    stage_mod = nn.Sequential(*list(model)[bounds[rank]:bounds[rank + 1]])
    del model
    pstage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    sched = Schedule1F1B(pstage, n_microbatches=a["microbatches"], loss_fn=lm_loss)
    opt = adamw(list(stage_mod.parameters()), fused=True)
    params = list(stage_mod.parameters())
    last = rank == world - 1
    note = f"stage layers {bounds[rank]}:{bounds[rank + 1]} of {bounds[-1]}"

    def step() -> None:
        x, y = next(data)
        mb_losses: list[torch.Tensor] = []
        if rank == 0:
            sched.step(x)
        elif last:
            sched.step(target=y, losses=mb_losses)
        else:
            sched.step()
        clip_(params, 1.0, sharded_sum_group=dist.group.WORLD)  # each stage owns its own parameters
        opt.step()
        opt.zero_grad(set_to_none=False)
        v = torch.stack(mb_losses).mean().detach() if last else torch.zeros(())
        dist.broadcast(v, src=world - 1)
        losses.append(float(v))

    return step, losses, note, stage_mod


def worker(a: dict, axes: list[str], rounds: int) -> dict:
    torch.set_num_threads(1)
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    out: dict = {}
    for axis in axes:
        cap_step, cap_losses, engine = make_capstan(a, axis, rank)
        peer_step, peer_losses, note, peer_model = make_peer(a, axis, rank, world)
        systems = {"capstan": cap_step, "peer": peer_step}
        for s in systems.values():
            for _ in range(a["warmup"]):
                s()
        elapsed: dict[str, list[float]] = {"capstan": [], "peer": []}
        for r in range(rounds):
            for name in (["capstan", "peer"] if r % 2 == 0 else ["peer", "capstan"]):
                dist.barrier()
                t0 = time.perf_counter()
                for _ in range(a["steps"]):
                    systems[name]()
                elapsed[name].append(time.perf_counter() - t0)
        out[axis] = {"elapsed": elapsed, "losses": {"capstan": cap_losses, "peer": peer_losses}, "note": note,
                     "loadavg": os.getloadavg()}
        del cap_step, peer_step, systems, engine, peer_model
        gc.collect()
        dist.barrier()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--axes", default="dp,tp,pp", help="comma-separated subset of dp,tp,pp")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8, help="global sequences per step (all layouts)")
    p.add_argument("--microbatches", type=int, default=4, help="pipeline micro-batches per step (pp)")
    p.add_argument("--zero-stage", type=int, default=0, help="capstan's parallel.zero_stage at dp=2")
    p.add_argument("--steps", type=int, default=2, help="timed steps per system per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per system")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="2 layers, d_model 128, seq 64, 2 rounds of 1 step")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("--mpirun", action="store_true",
                   help="start the 2 ranks with mpirun (bound to cores): capstan's collectives and p2p over MPI, "
                        "the PyTorch peers over their gloo groups")
    args = p.parse_args()
    if args.smoke:
        args.layers, args.d_model, args.heads, args.seq, args.steps, args.rounds = 2, 128, 4, 64, 1, 2
    a = {"layers": args.layers, "d_model": args.d_model, "heads": args.heads, "seq": args.seq,
         "batch": args.batch, "microbatches": args.microbatches, "zero_stage": args.zero_stage,
         "steps": args.steps, "warmup": args.warmup}
    axes = args.axes.split(",")
    print(f"torch {torch.__version__}, {os.cpu_count()} cpus, load average {os.getloadavg()}, {a}", flush=True)
    from capstan.comm.testing import run_mpirun, run_ranks

    launch, backend = (run_mpirun, None) if args.mpirun else (run_ranks, "gloo")
    res = launch(worker, 2, a, axes, args.rounds, init=True, backend=backend,
                    timeout=600 + 120 * args.rounds * len(axes) * args.steps, comm_timeout=600,
                    env={"CAPSTAN_LOG_LEVEL": "WARNING"})
    tokens = a["steps"] * a["batch"] * a["seq"]
    summary: dict = {"config": a, "axes": {}}
    ok = True
    for axis in axes:
        tok = {s: [tokens / max(r[axis]["elapsed"][s][i] for r in res) for i in range(args.rounds)]
               for s in ("capstan", "peer")}
        ratios = [c / q for c, q in zip(tok["capstan"], tok["peer"])]
        losses = res[0][axis]["losses"]
        first = (losses["capstan"][0], losses["peer"][0])
        d = {"layout": AXES[axis], "peer": PEER_NAME[axis], "tok_s": tok, "ratios": ratios,
             "median_tok_s": {s: statistics.median(v) for s, v in tok.items()},
             "median_ratio": statistics.median(ratios), "first_loss": first,
             "losses": losses, "note": res[0][axis]["note"], "loadavg_end": res[0][axis]["loadavg"]}
        summary["axes"][axis] = d
        print(f"[{axis} {AXES[axis]}] capstan tok/s {', '.join(f'{x:.0f}' for x in tok['capstan'])} | "
              f"{PEER_NAME[axis]} {', '.join(f'{x:.0f}' for x in tok['peer'])} | ratio per round "
              f"{', '.join(f'{x:.3f}' for x in ratios)} median {d['median_ratio']:.3f} | first loss "
              f"{first[0]:.6f} vs {first[1]:.6f} | {d['note']} | load {d['loadavg_end'][0]:.1f}", flush=True)
        if args.smoke and abs(first[0] - first[1]) > 1e-4 * abs(first[1]):
            print(f"[{axis}] FIRST-STEP LOSSES DIFFER: {first}", flush=True)
            ok = False
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
