"""How far `capstan plan` is from what runs measure, on this machine: the validation table of docs/plan.md.

    hatch run python tools/validate_plan.py                  # calibrate, run every row, rewrite the table
    hatch run python tools/validate_plan.py --machine M.json # reuse a calibration (it must hold the profiles)
    hatch run python tools/validate_plan.py --only A-dp2-z3  # some rows, table printed, docs untouched

It calibrates this machine (`capstan plan --calibrate`: rates, collectives, and the layers of every
(model, layout) of the rows whose model is not in HELD_OUT, profiled alone and with every core busy),
then runs each row
under `capstan launch -np N -- capstan train --plan MACHINE` and reads the run's plan.json: the
predicted and measured step time (median after the warm-up steps), peak resident memory of the
largest rank (VmHWM, the whole process) and the disk tier's file (its slots). The rows of the HELD_OUT models
("(held out)" in the table) are predicted from the other models' profiles (plan/fit.py): the planner's
accuracy on a model it never saw, which is every model a user brings. The targets of the planner issue:
memory within 10%, step time within 15%, every row. The table goes between the markers in
docs/plan.md, with the date, the machine and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "plan.md"
CONFIG = REPO / "examples" / "tiny.toml"  # the base; every row sets its model and layout over it
BEGIN, END = "<!-- validate_plan: begin -->", "<!-- validate_plan: end -->"
REC_BEGIN, REC_END = "<!-- validate_plan recommendation: begin -->", "<!-- validate_plan recommendation: end -->"
REC_MODEL, REC_BATCH, REC_RANKS = "B", 16, 2  # the job: model B, 16 sequences per step, on 2 ranks
MEMORY_TARGET, TIME_TARGET = 0.10, 0.15
WARMUP_STEPS = 3  # as capstan.engine.plan.run

MODELS = {  # name -> [model] keys
    "A": {"n_layers": 4, "d_model": 256, "n_heads": 8, "seq_len": 128},  # 3.3M parameters
    "B": {"n_layers": 6, "d_model": 384, "n_heads": 8, "seq_len": 128},  # 10.8M
    "C": {"n_layers": 8, "d_model": 512, "n_heads": 8, "seq_len": 256},  # 25.5M
    "D": {"n_layers": 4, "d_model": 256, "n_heads": 8, "seq_len": 2048},  # 3.7M, a long sequence
    "E": {"n_layers": 6, "d_model": 320, "n_heads": 5, "seq_len": 96},  # 7.4M, the planner issue's held-out model
    "F": {"n_layers": 5, "d_model": 288, "n_heads": 6, "seq_len": 112},  # 5.0M, held out (6 heads: tp 2)
}
# Models the calibration never profiles: their rows are predicted from the other models' profiles (plan/fit.py),
# as any model a user brings would be. The calibration takes the layers of every other model's rows, always,
# whichever rows a run selects (--only), so a held-out row's prediction never saw its model.
HELD_OUT = {"C", "E", "F"}
LONG = {"train.micro_batch_size": 1}  # model D's rows: one 2048-token sequence per rank and step


@dataclass(frozen=True)
class Row:
    name: str
    model: str
    ranks: int
    sets: dict = field(default_factory=dict)
    what: str = ""


ROWS = [
    Row("A-1", "A", 1, {}, "one rank"),
    Row("A-dp2-z0", "A", 2, {"parallel.zero_stage": 0}, "dp 2, ZeRO 0"),
    Row("A-dp2-z1", "A", 2, {"parallel.zero_stage": 1}, "dp 2, ZeRO 1"),
    Row("A-dp2-z2", "A", 2, {"parallel.zero_stage": 2, "train.grad_accum_steps": 2}, "dp 2, ZeRO 2, accum 2"),
    Row("A-dp2-z3", "A", 2, {"parallel.zero_stage": 3}, "dp 2, ZeRO 3 (chunks)"),
    Row("A-tp2", "A", 2, {"parallel.tp": 2}, "tp 2"),
    Row("A-pp2", "A", 2, {"parallel.pp": 2, "train.grad_accum_steps": 4}, "pp 2, 1F1B, 4 micro-batches"),
    Row("A-cpu", "A", 1, {"memory.offload": "cpu"}, "offload cpu (chunks in RAM)"),
    Row("A-disk", "A", 1, {"memory.offload": "disk", "memory.cpu_budget": "12MiB", "memory.chunk_size": 262144},
        "offload disk, 12 MiB of 57 MiB in RAM"),
    Row("A-rc", "A", 1, {"memory.activation_checkpointing": True}, "recompute"),
    Row("A-bf16", "A", 1, {"precision.dtype": "bf16"}, "bf16"),
    Row("B-1", "B", 1, {}, "one rank"),
    Row("B-dp2-z2-bf16", "B", 2, {"parallel.zero_stage": 2, "precision.dtype": "bf16"}, "dp 2, ZeRO 2, bf16"),
    Row("B-tp2-rc", "B", 2, {"parallel.tp": 2, "memory.activation_checkpointing": True}, "tp 2, recompute"),
    Row("B-disk", "B", 1, {"memory.offload": "disk", "memory.cpu_budget": "48MiB"}, "offload disk, 48 MiB in RAM"),
    # budgets many chunks deep, where the read-ahead's window has room (docs/plan.md, "Disk I/O": on 2 cores the
    # disk's time still adds to the step)
    Row("A-disk-deep", "A", 1, {"memory.offload": "disk", "memory.cpu_budget": "40MiB", "memory.chunk_size": 262144},
        "offload disk, 40 MiB of 57 MiB in RAM"),
    Row("B-disk-deep", "B", 1, {"memory.offload": "disk", "memory.cpu_budget": "112MiB"},
        "offload disk, 112 MiB in RAM"),
    Row("C-dp2-z3-disk", "C", 2, {"memory.offload": "disk", "memory.cpu_budget": "160MiB"},
        "dp 2, ZeRO-3 chunks on disk, 160 MiB in RAM per rank"),
    Row("C-pp2-rc", "C", 2, {"parallel.pp": 2, "train.grad_accum_steps": 4, "memory.activation_checkpointing": True,
                             "train.micro_batch_size": 2}, "pp 2, 4 micro-batches of 2, recompute"),
    Row("A-dp2-onebit", "A", 2, {"parallel.compression": "onebit", "parallel.compression_freeze_steps": 1},
        "dp 2, 1-bit Adam (frozen after step 1)"),
    Row("A-dp2-z2-int8", "A", 2, {"parallel.zero_stage": 2, "parallel.compression": "int8"}, "dp 2, ZeRO 2, int8"),
    Row("D-1", "D", 1, {**LONG}, "one rank, 2048 tokens"),
    Row("D-cp2", "D", 2, {**LONG, "parallel.cp": 2}, "cp 2 (Ulysses)"),
    Row("D-cp2-ring", "D", 2, {**LONG, "parallel.cp": 2, "parallel.cp_mode": "ring"}, "cp 2 (ring)"),
    Row("D-cp2-rc-tile", "D", 2, {**LONG, "parallel.cp": 2, "memory.activation_checkpointing": True,
                                  "memory.mlp_tile": 256}, "cp 2, recompute, MLP tiles of 256"),
    Row("D-cp2-z3", "D", 2, {**LONG, "parallel.cp": 2, "parallel.zero_stage": 3}, "cp 2, ZeRO-3 over the cp ranks"),
    Row("E-1", "E", 1, {}, "one rank"),
    Row("E-dp2-z2", "E", 2, {"parallel.zero_stage": 2, "train.micro_batch_size": 2, "train.grad_accum_steps": 2},
        "dp 2, ZeRO 2, micro 2 x accum 2"),
    Row("F-tp2-bf16", "F", 2, {"parallel.tp": 2, "precision.dtype": "bf16"}, "tp 2, bf16"),
]

BASE = {"train.micro_batch_size": 8, "train.warmup_steps": 2, "train.eval_every": 0, "data.max_bytes": 2_000_000,
        "log.every": 100}


def _value(v: object) -> str:
    return json.dumps(v) if isinstance(v, (str, bool)) else str(v)


def _sets(row: Row, steps: int, run_dir: Path) -> dict:
    out = {**BASE, **{f"model.{k}": v for k, v in MODELS[row.model].items()}, "train.steps": steps,
           "log.run_dir": str(run_dir), "memory.disk_dir": str(run_dir / "chunks"), **row.sets}
    return out


def _layouts(rows: list[Row]) -> list[tuple[object, object]]:
    """Each row's (shape, layout): what calibrate profiles (once per distinct shape) and runs tiny."""
    from capstan.engine.config import resolve
    from capstan.engine.plan.run import shape_layout

    out = []
    for row in rows:
        cfg, _ = resolve(str(CONFIG), [f"{k}={_value(v)}" for k, v in _sets(row, 10, Path("/tmp/x")).items()])
        out.append(shape_layout(cfg, row.ranks))
    return out


def run_row(row: Row, machine: Path, steps: int, work: Path, tag: str = "") -> tuple[dict, list[float]]:
    """plan.json of one run of `row`, and its step times after the warm-up steps."""
    run_dir = work / (row.name + tag)
    cmd = [sys.executable, "-m", "capstan.engine.cli", "launch", "-np", str(row.ranks), "--",
           "capstan", "train", "--config", str(CONFIG), "--plan", str(machine)]
    for k, v in _sets(row, steps, run_dir).items():
        cmd += ["--set", f"{k}={_value(v)}"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise SystemExit(f"{row.name} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    steps_s = [json.loads(line)["step_s"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return json.loads((run_dir / "plan.json").read_text()), steps_s[WARMUP_STEPS:]


def pooled(rows: list[Row], machine: Path, steps: int, work: Path, passes: int) -> dict[str, dict]:
    """Each row run `passes` times, a pass over every row at a time (a slow spell of the machine then hits
    every row a little instead of one row a lot); the measured step is the median of all passes' steps
    after the warm-up, the peaks the largest of the passes."""
    from statistics import median

    plans: dict[str, list[dict]] = {r.name: [] for r in rows}
    times: dict[str, list[float]] = {r.name: [] for r in rows}
    for p in range(passes):
        for row in rows:
            t = time.perf_counter()
            plan, steps_s = run_row(row, machine, steps, work, f"-{p}")
            plans[row.name].append(plan)
            times[row.name] += steps_s
            print(f"{row.name} pass {p}: {json.dumps(plan)} ({time.perf_counter() - t:.0f} s)", flush=True)
    out = {}
    for row in rows:
        first = plans[row.name][0]
        result = {"bottleneck": first.get("bottleneck", "")}
        for key in ("ram_bytes", "disk_bytes"):
            if key in first:
                pred, meas = first[key]["predicted"], max(p[key]["measured"] for p in plans[row.name])
                result[key] = {"predicted": pred, "measured": meas, "error": (pred - meas) / meas if meas else None}
        pred, meas = first["step_s"]["predicted"], median(times[row.name])
        result["step_s"] = {"predicted": pred, "measured": meas, "error": (pred - meas) / meas}
        out[row.name] = result
    return out


def _pct(row: dict | None) -> str:
    return "—" if row is None or row.get("error") is None else f"{row['error'] * 100:+.1f}%"


def table(rows: list[Row], results: dict[str, dict]) -> tuple[str, bool]:
    lines = ["| row | layout | step predicted / measured | error | RAM peak predicted / measured | error | "
             "disk file predicted / measured | error | bottleneck |",
             "|---|---|---|---|---|---|---|---|---|"]
    ok = True
    for row in rows:
        r = results[row.name]
        step, ram, disk = r.get("step_s"), r.get("ram_bytes"), r.get("disk_bytes")
        for x, target in ((step, TIME_TARGET), (ram, MEMORY_TARGET), (disk, MEMORY_TARGET)):
            if x is not None and x.get("error") is not None and abs(x["error"]) > target:
                ok = False
        size = f"{MODELS[row.model]['n_layers']} x {MODELS[row.model]['d_model']}"
        disk_cells = (f"{disk['predicted'] / 2**20:.1f} / {disk['measured'] / 2**20:.1f} MiB", _pct(disk)) \
            if disk else ("—", "—")
        held = " (held out)" if row.model in HELD_OUT else ""
        lines.append(f"| {row.name}{held} | {size}, {row.what} "
                     f"| {step['predicted'] * 1e3:.0f} / {step['measured'] * 1e3:.0f} ms "
                     f"| {_pct(step)} | {ram['predicted'] / 2**20:.0f} / {ram['measured'] / 2**20:.0f} MiB "
                     f"| {_pct(ram)} "
                     f"| {disk_cells[0]} | {disk_cells[1]} | {r.get('bottleneck', '')} |")
    return "\n".join(lines), ok


def _row_of(name: str, layout: object) -> Row:
    """A row running `layout` (a plan Layout) of the recommendation's model."""
    sets = {"parallel.dp": layout.dp, "parallel.tp": layout.tp, "parallel.pp": layout.pp,
            "parallel.zero_stage": layout.zero_stage, "memory.offload": layout.offload,
            "train.micro_batch_size": layout.micro, "train.grad_accum_steps": layout.accum,
            "memory.activation_checkpointing": layout.recompute}
    if layout.offload == "disk":
        sets["memory.cpu_budget"] = layout.cpu_budget
    return Row(name, REC_MODEL, layout.dp * layout.tp * layout.pp, sets, name)


def recommendation(machine: Path, steps: int, work: Path, rounds: int = 2) -> str:
    """The planner's first choice for the job against the engine's default layout (dp = every rank, ZeRO 0,
    no offload, the config's micro-batch), both run `rounds` times, interleaved; measured tokens/s."""
    from dataclasses import replace

    from capstan.engine.config import resolve
    from capstan.engine.plan import load_machine, search
    from capstan.engine.plan.run import shape_layout

    cfg, _ = resolve(str(CONFIG), [f"{k}={_value(v)}" for k, v in _sets(Row("job", REC_MODEL, REC_RANKS), 10,
                                                                           Path("/tmp/x")).items()])
    shape, default = shape_layout(cfg, REC_RANKS)
    m = replace(load_machine(machine), ranks_per_node=REC_RANKS)
    result = search(shape, m, REC_BATCH, default, measure=True)
    best = result.ranked[0]
    default = replace(default, micro=REC_BATCH // REC_RANKS)
    runs = {"recommended": _row_of("recommended", best.layout), "default": _row_of("default", default)}
    tokens: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(rounds):
        for key, row in runs.items():
            out, _ = run_row(row, machine, steps, work, f"-{r}")
            tokens[key].append(REC_BATCH * shape.seq / out["step_s"]["measured"])
    med = {k: sorted(v)[len(v) // 2] for k, v in tokens.items()}
    default_predicted = next((c.time.tokens_per_s for c in result.ranked if c.layout == replace(default, dp=REC_RANKS)),
                             float("nan"))
    def describe(lay) -> str:
        return (f"dp {lay.dp} x tp {lay.tp} x pp {lay.pp}, ZeRO {lay.zero_stage}, offload {lay.offload}, "
                f"micro {lay.micro} x accum {lay.accum}{', recompute' if lay.recompute else ''}")
    return "\n".join([
        f"The job: model {REC_MODEL} ({MODELS[REC_MODEL]['n_layers']} x {MODELS[REC_MODEL]['d_model']}), "
        f"{REC_BATCH} sequences of {shape.seq} tokens per step, {REC_RANKS} ranks; {len(result.ranked)} of "
        f"{result.tried} layouts fit.", "",
        "| layout | predicted tokens/s | measured tokens/s (each round) |", "|---|---|---|",
        f"| planner's choice: {describe(best.layout)} | {best.time.tokens_per_s:,.0f} | "
        f"{', '.join(f'{t:,.0f}' for t in tokens['recommended'])} |",
        f"| engine default: {describe(default)} | "
        f"{default_predicted:,.0f} | "
        f"{', '.join(f'{t:,.0f}' for t in tokens['default'])} |", "",
        f"Measured, median of the rounds: the planner's choice "
        f"{med['recommended'] / med['default']:.2f}x the default."])


def _replace_between(doc: str, begin: str, end: str, text: str) -> str:
    head, rest = doc.split(begin)
    _, tail = rest.split(end)
    return head + begin + "\n" + text + "\n" + end + tail


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--machine", help="a machine file to reuse (default: calibrate now)")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--passes", type=int, default=3, help="runs of every row (their steps pooled)")
    parser.add_argument("--only", nargs="*", help="row names")
    parser.add_argument("--work", help="where runs go (default: a temporary directory)")
    parser.add_argument("--no-recommendation", action="store_true", help="skip the planner's choice vs the default")
    args = parser.parse_args()
    rows = [r for r in ROWS if not args.only or r.name in args.only]
    work = Path(args.work or tempfile.mkdtemp(prefix="capstan-validate-plan-"))
    work.mkdir(parents=True, exist_ok=True)
    machine = Path(args.machine) if args.machine else work / "machine.json"
    if not args.machine:
        from capstan.engine.plan.calibrate import calibrate
        from capstan.engine.plan.spec import save_machine

        calibrated = [r for r in ROWS if r.model not in HELD_OUT]  # all of them, whatever --only selects
        save_machine(calibrate(work / "calibrate", shapes=_layouts(calibrated)), machine)
    results = pooled(rows, machine, args.steps, work, args.passes)
    text, ok = table(rows, results)
    print(text)
    print("every row within target" if ok else "NOT every row within target "
          f"(memory {MEMORY_TARGET:.0%}, step time {TIME_TARGET:.0%})")
    rec = None if args.no_recommendation else recommendation(machine, args.steps, work)
    if rec:
        print(rec)
    if args.only:
        return
    stamp = (f"Regenerated {time.strftime('%Y-%m-%d')} on this machine ({os.cpu_count()} cores) by "
             f"`hatch run python tools/validate_plan.py` ({args.passes} passes of {args.steps} steps per row); "
             "targets: memory within 10%, step time within 15%.\n\n")
    doc = _replace_between(DOC.read_text(), BEGIN, END, stamp + text)
    if rec:
        doc = _replace_between(doc, REC_BEGIN, REC_END, rec)
    DOC.write_text(doc)


if __name__ == "__main__":
    main()
