"""Data parallelism over a slow network: exact vs 1-bit Adam vs int8 ZeRO on simulated hosts (root only).

    hatch run python tools/bench_slow_network.py                        # dp 4 on 4 hosts, 100 Mbit/s and 1 Gbit/s
    hatch run python tools/bench_slow_network.py --rates 100mbit --steps 20 --plot ""
    hatch run python tools/bench_slow_network.py --smoke

Each rank is a "host" of its own (capstan.comm.testing.netns: network namespaces on one switch, every
link limited to the rate in both directions by tc; netem adds `--delay-ms` where the kernel has it,
tbf limits the rate alone where it does not, and the table says which) started torchrun-style with
`ip netns exec`, gloo over the shaped links, one thread per rank. The reference GPT (`--layers` x
`--d-model`, the byte vocabulary, fp32, the default corpus) trains `--steps` steps in each mode:

    exact-z0  compression none, ZeRO 0 (all-reduce of fp32 gradients)
    onebit    1-bit Adam, ZeRO 0, exact for `--freeze` steps
    exact-z2  compression none, ZeRO 2 with its default zero2_collective = "all_reduce" (gradients
              all-reduced, each rank keeps its shard; all-gather of parameters)
    exact-z2rs  compression none, ZeRO 2 with zero2_collective = "reduce_scatter" (the schema's setting
              for bandwidth-bound networks: half the gradient bytes of an all-reduce)
    int8      int8 ZeRO 2
    exact-disk  compression none, states offloaded to disk under `--budget` (ZeRO-3 through chunks)
    onebit-disk 1-bit Adam, states offloaded to disk under `--budget` (chunks replicated on every rank,
                the residuals among them)

The disk modes run where `--modes` names them (not by default).

Every mode sees the same batches. tokens/s is the median over the steps after the freeze (the same
window for every mode), "whole run" all the tokens over the sum of all the step times (1-bit Adam's
exact freeze included); loss is the last step's and the mean of the last five. Each compressed mode
is compared with the exact modes at its own stage (the same memory per rank) and with the fastest
exact mode at that link (ratios in the report and under "ratios" in `--json`). The issue's targets:
at 100 Mbit/s the compressed modes >= 3x exact's tokens/s; at 1 Gbit/s >= what exact gets at 4x
that bandwidth (`--peer-factor 4`: the exact modes there, against the same stage and the fastest);
final loss within 2% of exact's.
The loss curves against step and wall time go to `--plot` (a PNG).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODES = {"exact-z0": (0, "none", "none"), "onebit": (0, "onebit", "none"), "exact-z2": (2, "none", "none"),
         "exact-z2rs": (2, "none", "none"),
         "int8": (2, "int8", "none"), "exact-disk": (3, "none", "disk"), "onebit-disk": (0, "onebit", "disk")}
DEFAULT_MODES = "exact-z0,onebit,exact-z2,exact-z2rs,int8"
# each compressed mode and the exact modes at its own stage (the same memory per rank)
SAME_STAGE = {"onebit": ("exact-z0",), "int8": ("exact-z2", "exact-z2rs"), "onebit-disk": ("exact-disk",)}


def config_toml(a: argparse.Namespace, mode: str, run_dir: Path) -> str:
    stage, compression, offload = MODES[mode]
    memory = "" if offload == "none" else f"""
[memory]
offload = "{offload}"
cpu_budget = "{a.budget}"
disk_dir = "{run_dir / 'chunks'}"
"""
    return f"""
[model]
n_layers = {a.layers}
n_heads = 4
d_model = {a.d_model}
seq_len = {a.seq}
[train]
steps = {a.steps}
micro_batch_size = {a.micro}
lr = 1e-3
warmup_steps = 3
eval_every = 0
[parallel]
dp = {a.hosts}
zero_stage = {stage}
zero2_collective = "{'reduce_scatter' if mode == 'exact-z2rs' else 'all_reduce'}"
compression = "{compression}"
compression_freeze_steps = {a.freeze}
[precision]
dtype = "fp32"
[log]
every = {a.steps}
run_dir = "{run_dir}"
{memory}"""


def run_mode(a: argparse.Namespace, hosts: list, mode: str, work: Path, port: int) -> list[dict]:
    """One training run across the hosts; rank 0's step records."""
    from capstan.comm.testing import clean_env
    from capstan.comm.testing.netns import IFNAME

    run_dir = work / mode
    work.mkdir(parents=True, exist_ok=True)
    cfg = work / f"{mode}.toml"
    cfg.write_text(config_toml(a, mode, run_dir))
    procs = []
    for rank, host in enumerate(hosts):
        env = clean_env({"RANK": str(rank), "WORLD_SIZE": str(len(hosts)), "LOCAL_RANK": "0",
                          "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": hosts[0].address, "MASTER_PORT": str(port),
                          "GLOO_SOCKET_IFNAME": IFNAME, "CAPSTAN_COMM_BACKEND": "gloo",
                          "CAPSTAN_COMM_TIMEOUT": "300", "OMP_NUM_THREADS": "1"})
        log = open(work / f"{mode}.rank{rank}.log", "w")
        argv = [sys.executable, "-m", "capstan.engine.cli", "train", "--config", str(cfg)]
        procs.append(subprocess.Popen(host.exec(argv), stdout=log, stderr=subprocess.STDOUT, env=env))
        log.close()
    codes = [p.wait(timeout=a.timeout) for p in procs]
    if codes != [0] * len(hosts):
        tail = (work / f"{mode}.rank0.log").read_text()[-3000:]
        raise SystemExit(f"{mode}: ranks exited {codes}\n{tail}")
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(records: list[dict], skip: int) -> dict:
    steady = records[skip:]
    losses = [r["loss"] for r in records]
    total_s = sum(r["step_s"] for r in records)
    return {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "step_s": statistics.median(r["step_s"] for r in steady),
            # the whole run, freeze included: all tokens over the sum of all step times
            "whole_tokens_per_s": sum(r["tokens_per_s"] * r["step_s"] for r in records) / total_s,
            "whole_step_s": total_s / len(records), "total_s": total_s,
            "wire_bytes": statistics.median(r.get("comm.wire_bytes", 0) for r in steady),
            "final_loss": losses[-1], "last5_loss": sum(losses[-5:]) / len(losses[-5:]),
            "ram_peak": max(r.get("mem.cpu.peak_bytes", 0) for r in records),
            "disk_peak": max(r.get("mem.disk.peak_bytes", 0) for r in records),
            "losses": losses, "step_times": [r["step_s"] for r in records]}


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = list(results)
    fig, axes = plt.subplots(len(rates), 2, figsize=(11, 3.6 * len(rates)), squeeze=False)
    for row, rate in zip(axes, rates):
        for mode, s in results[rate].items():
            wall, t = [], 0.0
            for dt in s["step_times"]:
                t += dt
                wall.append(t)
            row[0].plot(range(1, len(s["losses"]) + 1), s["losses"], label=mode)
            row[1].plot(wall, s["losses"], label=mode)
        row[0].set(title=f"{rate}: loss vs step", xlabel="step", ylabel="loss")
        row[1].set(title=f"{rate}: loss vs wall time", xlabel="seconds (sum of step times)", ylabel="loss")
        row[0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hosts", type=int, default=4)
    p.add_argument("--rates", default="100mbit,1gbit")
    p.add_argument("--peer-factor", type=int, default=4, help="exact modes also at this times the last rate")
    p.add_argument("--delay-ms", type=float, default=0.0, help="added each way where netem exists")
    p.add_argument("--modes", default=DEFAULT_MODES)
    p.add_argument("--budget", default="24MiB", help="memory.cpu_budget of the disk modes (per rank)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro", type=int, default=2)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--freeze", type=int, default=20)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--work", default="/tmp/capstan-bench-slow-network")
    p.add_argument("--json", default="")
    p.add_argument("--plot", default=str(REPO / "docs" / "img" / "slow_network_loss.png"))
    p.add_argument("--smoke", action="store_true", help="2 hosts, one rate, 6 steps, a tiny model")
    a = p.parse_args()
    if a.smoke:
        a.hosts, a.rates, a.peer_factor, a.layers, a.d_model, a.steps, a.freeze, a.plot = (
            2, "100mbit", 0, 1, 64, 6, 3, "")
    from capstan.comm.testing.netns import netns_reason, shaping, simulated_hosts

    why = netns_reason()
    if why is not None:
        raise SystemExit(f"bench_slow_network: {why}")
    kind = shaping()
    rates = [r for r in a.rates.split(",") if r]
    plan = [(rate, a.modes.split(",")) for rate in rates]
    if a.peer_factor:
        from capstan.comm.testing.netns import rate_bits

        peer = f"{int(rate_bits(rates[-1]) * a.peer_factor / 1e6)}mbit"
        plan.append((peer, [m for m in a.modes.split(",") if m.startswith("exact")]))
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {}
    skip = max(a.freeze, 3)
    port = 29600
    print(f"dp {a.hosts} on {a.hosts} simulated hosts, links shaped by {kind} "
          f"({f'delay {a.delay_ms:.1f} ms each way' if kind == 'netem' else 'no added delay'}); "
          f"{a.layers} layers x d {a.d_model}, seq {a.seq}, micro {a.micro}; steps {a.steps}, freeze {a.freeze}; "
          f"tokens/s = median over steps {skip + 1}..{a.steps}", flush=True)
    for rate, modes in plan:
        results[rate] = {}
        with simulated_hosts(a.hosts, rate=rate, delay_ms=a.delay_ms, subnet="10.78.0") as hosts:
            for mode in modes:
                port += 1
                t0 = time.perf_counter()
                s = summarize(run_mode(a, hosts, mode, work / rate, port), skip)
                results[rate][mode] = s
                print(f"{rate:>9} {mode:>10}: {s['tokens_per_s']:8.0f} tok/s  step {s['step_s']:.3f} s  "
                      f"(whole run {s['whole_tokens_per_s']:.0f} tok/s, {s['total_s']:.1f} s)  "
                      f"wire {s['wire_bytes'] / 2**20:7.2f} MiB  final loss {s['final_loss']:.4f} "
                      f"(last 5 {s['last5_loss']:.4f})  states RAM/disk peak {s['ram_peak'] / 2**20:.1f}/"
                      f"{s['disk_peak'] / 2**20:.1f} MiB  [{time.perf_counter() - t0:.0f} s]", flush=True)
    ratios = []

    def ratio(rate: str, mode: str, base_rate: str, base: str, what: str) -> None:
        m, b = results[rate][mode], results[base_rate][base]
        row = {"rate": rate, "mode": mode, "base_rate": base_rate, "base": base, "reference": what,
               "tokens_per_s": m["tokens_per_s"] / b["tokens_per_s"],
               "whole_tokens_per_s": m["whole_tokens_per_s"] / b["whole_tokens_per_s"],
               "final_loss": m["final_loss"] / b["final_loss"] - 1,
               "last5_loss": m["last5_loss"] / b["last5_loss"] - 1}
        ratios.append(row)
        print(f"{rate:>9} {mode:>11} / {base_rate} {base:<10} ({what:<21}): {row['tokens_per_s']:5.2f}x "
              f"(whole run {row['whole_tokens_per_s']:5.2f}x)  final loss {row['final_loss']:+.2%} "
              f"(last 5 {row['last5_loss']:+.2%})")

    def compare(rate: str, mode: str, base_rate: str, bases: tuple[str, ...], fast: str | None) -> None:
        """Against each exact mode at the same stage, and the fastest exact mode (one line if they coincide)."""
        for base in bases:
            if base in results[base_rate]:
                ratio(rate, mode, base_rate, base, "same stage" + (" = fastest" if base == fast else ""))
        if fast is not None and fast not in bases and mode != "onebit-disk":
            ratio(rate, mode, base_rate, fast, "fastest exact")

    def fastest_exact(rate: str) -> str | None:
        exact = [m for m in results[rate] if m.startswith("exact") and m != "exact-disk"]
        return max(exact, key=lambda m: results[rate][m]["tokens_per_s"]) if exact else None

    print("\nratios (tokens/s: median after the freeze; whole run: all tokens / all step time):")
    for rate in rates:
        r, fast = results[rate], fastest_exact(rate)
        for mode, bases in SAME_STAGE.items():
            if mode not in r:
                continue
            compare(rate, mode, rate, bases, fast)
    if a.peer_factor:
        peer, fast = plan[-1][0], fastest_exact(plan[-1][0])
        for mode, bases in SAME_STAGE.items():
            if mode not in results[rates[-1]]:
                continue
            compare(rates[-1], mode, peer, bases, fast)
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "shaping": kind, "results": results, "ratios": ratios},
                                           indent=1))
    if a.plot:
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        plot({rate: results[rate] for rate in rates}, Path(a.plot))
        print(f"wrote {a.plot}")
    os.sync()


if __name__ == "__main__":
    main()
