"""The DeepSpeed peers of tools/bench_engine.py: ZeRO-2 / ZeRO-3, with `offload_optimizer: cpu` (the systems
`ds-zero2`, `ds-zero3`) or without (`ds-zero2-nooffload`, `ds-zero3-nooffload`: `a["ds_offload"]` false; the
optimizer is then what DeepSpeed builds for its CPU accelerator from `"type": "AdamW"`).

`run_deepspeed` starts `world` ranks of this file with `--worker` under the
python given to bench_engine.py's `--deepspeed` (a separate venv with
deepspeed; capstan's comm, tensorpar and engine sources are put on its
PYTHONPATH, capstan.native is not needed), with mpirun when the benchmark runs
under `--mpirun`, else as env:// processes; each rank trains the same GPT on
the same batches as bench_engine.py's systems and writes its timings as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from bench_engine import VOCAB, batches, timed_steps


def ds_worker(a: dict, stage: int) -> dict:
    """DeepSpeed ZeRO-`stage` on this rank, with offload_optimizer cpu unless `a["ds_offload"]` is false (run
    under --deepspeed's python)."""
    torch.set_num_threads(1)
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    from types import SimpleNamespace

    from capstan import comm
    from capstan.tensorpar import GPTConfig, build_gpt

    # capstan.engine's defaults, written out: the engine package needs capstan.native, not in this venv.
    t = SimpleNamespace(seed=1234, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, grad_clip=1.0)
    torch.manual_seed(t.seed)
    gpt = GPTConfig(vocab_size=a.get("vocab", VOCAB), seq_len=a["seq"], d_model=a["d_model"], n_heads=a["heads"],
                    n_layers=a["layers"], dropout=0.0)
    model = build_gpt(gpt, comm.single_process_groups().tp, seed=t.seed)
    n_params = sum(p.numel() for p in model.parameters())
    params = list(model.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    ds_config = {
        "train_micro_batch_size_per_gpu": a["micro"], "gradient_accumulation_steps": 1,
        "gradient_clipping": t.grad_clip, "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": t.lr, "betas": [t.beta1, t.beta2], "eps": t.eps,
                                                  "weight_decay": t.weight_decay}},
        "zero_optimization": {"stage": stage, **({"offload_optimizer": {"device": "cpu"}}
                                                 if a.get("ds_offload", True) else {})},
    }
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=ds_config)
    loss_of = model.loss
    data = batches(a["micro"], a["seq"], rank, world, a.get("vocab", VOCAB))
    losses: list[float] = []

    def step() -> None:
        x, y = next(data)
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        v = loss.detach().clone()
        dist.all_reduce(v)
        losses.append(float(v) / world)

    note = type(engine.optimizer).__name__ + "/" + type(getattr(engine.optimizer, "optimizer", None)).__name__
    return {**timed_steps(step, a, world), "losses": losses, "params": n_params, "note": note}


def run_deepspeed(python: str, stage: int, world: int, a: dict, tries: int = 3) -> list[dict]:
    """`run_deepspeed_once`, started again (a fresh port) when a run hangs or fails: one of
    DeepSpeed's ranks under mpirun once waited forever for a peer that had gone (session 7), which
    stalled a whole benchmark. A retried run is named on stderr."""
    import subprocess

    for attempt in range(1, tries + 1):
        try:
            return run_deepspeed_once(python, stage, world, a)
        except subprocess.TimeoutExpired:
            print(f"deepspeed ZeRO-{stage} run {attempt} of {tries} hung; killed", file=sys.stderr, flush=True)
        except DeepSpeedFailed as e:
            print(f"deepspeed ZeRO-{stage} run {attempt} of {tries} failed: {e}", file=sys.stderr, flush=True)
    raise RuntimeError(f"deepspeed ZeRO-{stage} failed or hung {tries} times")


class DeepSpeedFailed(RuntimeError):
    """A DeepSpeed run of the benchmark exited non-zero before every rank wrote its results."""


DS_RUN_TIMEOUT_S = 300  # a DeepSpeed run of the benchmark takes 30-90 s here


def run_deepspeed_once(python: str, stage: int, world: int, a: dict) -> list[dict]:
    """`world` ranks of `python tools/bench_engine_deepspeed.py --worker` (env:// rendezvous, gloo)."""
    import signal
    import socket
    import subprocess
    import tempfile

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(prefix="bench-ds-") as tmp:
        if a.get("mpirun"):  # the same launcher (and core binding) as capstan's ranks under --mpirun
            from capstan.comm.testing.harness import mpirun_args

            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                       DS_ACCELERATOR="cpu",
                       PYTHONPATH=os.pathsep.join(f"{root}/packages/{p}/src" for p in ("comm", "tensorpar", "engine")))
            for k in [k for k in env if k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]:
                del env[k]
            out = os.path.join(tmp, "result.%r.json")
            cmd = mpirun_args(world) + [python, os.path.abspath(__file__), "--worker", json.dumps(a),
                                        "--ds-stage", str(stage), "--json", out]
            log = os.path.join(tmp, "log")
            proc = subprocess.Popen(cmd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=DS_RUN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # mpirun and every rank it started
                proc.wait()
                raise
            files = [out.replace("%r", str(r)) for r in range(world)]
            if code and all(os.path.exists(f) for f in files):
                # Every rank wrote its timings, then one aborted in torch's teardown ("terminate
                # called without an active exception", once in session 7): the run itself is complete.
                print(f"deepspeed ZeRO-{stage} exited {code} after writing every rank's results; kept",
                      file=sys.stderr, flush=True)
            elif code:
                raise DeepSpeedFailed(f"deepspeed under mpirun exited {code}:\n" + open(log).read()[-3000:])
            return [json.load(open(f)) for f in files]
        procs = []
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                       LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu",
                       PYTHONPATH=os.pathsep.join(f"{root}/packages/{p}/src" for p in ("comm", "tensorpar", "engine")))
            out = os.path.join(tmp, f"result.{r}.json")
            procs.append(subprocess.Popen([python, os.path.abspath(__file__), "--worker", json.dumps(a),
                                           "--ds-stage", str(stage), "--json", out], env=env,
                                          stdout=open(os.path.join(tmp, f"log.{r}"), "w"), stderr=subprocess.STDOUT))
        try:
            codes = [p.wait(timeout=DS_RUN_TIMEOUT_S) for p in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
                p.wait()
            raise
        if any(codes):
            raise DeepSpeedFailed(
                f"deepspeed ranks exited {codes}:\n" + open(os.path.join(tmp, "log.0")).read()[-3000:]
            )
        return [json.load(open(os.path.join(tmp, f"result.{r}.json"))) for r in range(world)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", required=True, help="the benchmark's model and step settings, as JSON")
    p.add_argument("--ds-stage", type=int, default=2)
    p.add_argument("--json", required=True, help="where this rank writes its results (%%r: the rank)")
    args = p.parse_args()
    for var, ompi in (("RANK", "OMPI_COMM_WORLD_RANK"), ("WORLD_SIZE", "OMPI_COMM_WORLD_SIZE"),
                      ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK"),
                      ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")):
        if var not in os.environ and ompi in os.environ:  # started by mpirun (--mpirun)
            os.environ[var] = os.environ[ompi]
    res = ds_worker(json.loads(args.worker), args.ds_stage)
    with open(args.json.replace("%r", os.environ.get("RANK", "0")), "w") as f:
        json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
