"""`capstan plan`: what a model x machine x layout needs per rank and tier, how long its step takes, which
layout is fastest, before a run.

    capstan plan --calibrate [--config my.toml]               # measure this machine (about half a minute)
    capstan plan --config examples/offload.toml               # the config's model and layout, this machine
    capstan plan --config my.toml --search --global-batch 64  # every layout that fits, fastest first
    capstan plan --model mt-nlg-530b --machine dgx-a100-80gb --nodes 35 --tp 8 --pp 35 --precision bf16 --recompute

Exit 0 when it fits (with --search: when some layout fits), 1 when a tier is short (the line says by
how much), 2 for bad input. docs/plan.md.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace

__all__ = ["add_parser", "cmd_plan"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..plan.spec import DEVICES, MODELS, NODES  # not ..plan: `capstan launch` builds this parser, torch-free

    p = sub.add_parser("plan", help="memory per rank and tier, step time and the fastest layout of a model x "
                                    "machine x layout (docs/plan.md)")
    m = p.add_argument_group("model (a preset, a capstan config's [model], or sizes)")
    m.add_argument("--model", help=f"a preset: {', '.join(MODELS)}")
    m.add_argument("--config", help="a capstan config: its [model] and its layout ([parallel], [memory], [train], "
                                   "[precision]); flags below override")
    for name in ("layers", "hidden", "heads", "vocab", "seq"):
        m.add_argument(f"--{name}", type=int)
    mach = p.add_argument_group("machine")
    mach.add_argument("--machine", default="local",
                      help=f"a node ({', '.join(NODES)}), a device ({', '.join(DEVICES)}, with --devices-per-node "
                           "and --host-ram), a machine file from --calibrate, or local (this machine: its "
                           "calibration when there is one; default)")
    mach.add_argument("--nodes", type=int, default=1)
    mach.add_argument("--devices-per-node", type=int)
    mach.add_argument("--ranks-per-node", type=int, help="CPU ranks per node (a CPU machine)")
    mach.add_argument("--host-ram", help="RAM per node, e.g. 256GB")
    mach.add_argument("--disk", help="free disk per node for offload, e.g. 2TB")
    mach.add_argument("--disk-read", help="bytes/s one rank reads its disk tier at, all ranks at once, e.g. 3GB "
                                          "(a device preset has none: offload disk is timed only with both)")
    mach.add_argument("--disk-write", help="bytes/s one rank writes its disk tier at, e.g. 1.5GB")
    mach.add_argument("--calibrate", action="store_true",
                      help="measure this machine's rates (and the --config model's layers) and save them")
    mach.add_argument("--out", help="with --calibrate: the machine file to write (default: this machine's)")
    mach.add_argument("--disk-dir", default="runs/calibrate", help="with --calibrate: where to measure the disk")
    mach.add_argument("--quick", action="store_true",
                      help="with --calibrate: a rougher calibration (collectives of 2 ranks only, 32 MiB of disk, "
                           "a bf16 block of one sequence timed 3 times)")
    lay = p.add_argument_group("layout (docs/config.md names)")
    for name in ("dp", "tp", "pp", "cp", "zero-stage", "micro", "accum", "virtual-stages"):
        lay.add_argument(f"--{name}", type=int)
    lay.add_argument("--cp-mode", choices=("ulysses", "ring"), help="how attention crosses the cp ranks")
    lay.add_argument("--mlp-tile", type=int, help="tokens per tile of each block's MLP (0: off)")
    lay.add_argument("--offload", choices=("none", "cpu", "disk"))
    lay.add_argument("--precision", choices=("fp32", "bf16", "fp16"))
    lay.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"))
    lay.add_argument("--compression", choices=("none", "onebit", "int8"),
                     help="compressed data parallelism (docs/parallelism.md, \"Slow networks\")")
    lay.add_argument("--recompute", action="store_true", default=None, help="activation checkpointing")
    lay.add_argument("--sequence-parallel", action="store_true", default=None)
    lay.add_argument("--cpu-budget", help="bytes of chunks in RAM (offload disk), e.g. 64GB")
    lay.add_argument("--gpu-budget", help="bytes of chunks on the device")
    p.add_argument("--search", action="store_true", help="rank every layout that fits by predicted tokens/s")
    p.add_argument("--global-batch", type=int, help="with --search: sequences per step (default: the layout's "
                                                    "micro x accum x dp)")
    p.add_argument("--top", type=int, default=10, help="with --search: how many layouts to show")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=cmd_plan)


def _size(text: str | None, flag: str) -> int | None:
    from ..config.load import parse_size
    from ..plan import PlanError

    if text is None:
        return None
    value = parse_size(text)
    if value is None or value <= 0:
        raise PlanError(f"{flag} = {text!r}: expected a positive size such as 64GB or 512MiB")
    return value


def _request(args: argparse.Namespace) -> tuple[object, dict, dict]:
    """(ModelShape or None, layout fields, machine fields) from --config, a preset and the flags."""
    from ..plan import MODELS, ModelShape, PlanError

    shape_kw: dict = {}
    layout_kw: dict = {}
    if args.config:
        from ..config.load import load_config
        from ..plan.run import shape_layout

        shape, layout = shape_layout(load_config(args.config))
        shape_kw = {k: getattr(shape, k) for k in ("layers", "hidden", "heads", "vocab", "seq")}
        layout_kw = {k: v for k, v in asdict(layout).items()}
    if args.model:
        if args.model not in MODELS:
            raise PlanError(f"unknown model preset {args.model!r}: expected one of {', '.join(MODELS)}")
        preset = MODELS[args.model]
        shape_kw = {k: getattr(preset, k) for k in ("layers", "hidden", "heads", "vocab", "seq")}
    for k in ("layers", "hidden", "heads", "vocab", "seq"):
        if getattr(args, k) is not None:
            shape_kw[k] = getattr(args, k)
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in shape_kw]
    shape = None
    if not missing:
        shape = ModelShape(**shape_kw, name=args.model or "")
    elif not args.calibrate:
        raise PlanError(f"no model: give --model, --config, or all of --layers --hidden --heads --vocab --seq "
                        f"(missing {', '.join('--' + k for k in missing)})")
    for k in ("dp", "tp", "pp", "cp", "cp_mode", "mlp_tile", "zero_stage", "micro", "accum", "virtual_stages",
              "offload", "precision", "schedule", "recompute", "sequence_parallel", "compression"):
        if getattr(args, k) is not None:
            layout_kw[k] = getattr(args, k)
    for k in ("cpu_budget", "gpu_budget"):
        if getattr(args, k) is not None:
            layout_kw[k] = _size(getattr(args, k), "--" + k.replace("_", "-"))
    machine_kw: dict = {}
    for k in ("devices_per_node", "ranks_per_node"):
        if getattr(args, k) is not None:
            machine_kw[k] = getattr(args, k)
    for k in ("host_ram", "disk", "disk_read", "disk_write"):
        if getattr(args, k) is not None:
            machine_kw[k] = _size(getattr(args, k), "--" + k.replace("_", "-"))
    return shape, layout_kw, machine_kw


def _machine(args: argparse.Namespace, machine_kw: dict, ranks: int) -> tuple[object, str | None]:
    """The machine, and the file its layer profiles are saved back to (a calibrated local machine)."""
    from ..plan import machine_preset
    from ..plan.calibrate import default_machine_path

    name, saved = args.machine, None
    if name in ("local", "this") and default_machine_path().exists():
        name = saved = str(default_machine_path())
    elif name.endswith(".json"):
        saved = name
    if (name in ("local", "this") or saved) and "ranks_per_node" not in machine_kw:
        machine_kw["ranks_per_node"] = ranks
    return machine_preset(name, nodes=args.nodes, **machine_kw), saved


def cmd_plan(args: argparse.Namespace) -> int:
    from ..plan import Layout, memory_plan, save_machine

    shape, layout_kw, machine_kw = _request(args)
    if args.calibrate:
        return _calibrate(args, shape, Layout(**layout_kw))
    layout = Layout(**layout_kw)
    machine, saved = _machine(args, machine_kw, (layout.dp or 1) * layout.tp * layout.pp * layout.cp)
    local = saved is not None and machine.device is None
    if args.search:
        code = _search(args, shape, machine, layout, local)
    else:
        plan = memory_plan(shape, machine, layout)
        time = None
        if machine.rates is not None:
            from ..plan import step_time

            time = step_time(shape, machine, layout, measure=local)
        code = _print_plan(args, shape, machine, plan, time)
    if local:
        save_machine(replace(machine, ranks_per_node=1), saved)  # keeps the layer profiles measured now
    return code


def _print_plan(args: argparse.Namespace, shape: object, machine: object, plan: object, time: object) -> int:
    short = plan.shortfall()
    if args.json:
        out = {"params": shape.params, "params_per_rank": plan.params_per_rank, "stage": plan.stage,
               "layout": asdict(plan.layout),
               "items": [{"what": i.what, "tier": i.tier, "bytes": i.bytes} for i in plan.items],
               "total": {t: plan.total(t) for t in ("device", "ram", "disk")},
               "capacity": plan.capacity, "fits": plan.fits, "short": short, "problems": list(plan.problems)}
        if time is not None:
            out["step"] = {"seconds": time.seconds, "tokens_per_s": time.tokens_per_s, "bottleneck": time.bottleneck,
                           "parts": dict(time.parts), "rates": time.source}
        sys.stdout.write(json.dumps(out) + "\n")
        return 0 if plan.fits else 1
    lay = plan.layout
    print(f"{shape.name or 'model'}: {shape.params / 1e9:.3g}B parameters ({shape.layers} x {shape.hidden}, "
          f"{shape.heads} heads, vocab {shape.vocab}, seq {shape.seq}) on {machine.name} x {machine.nodes} "
          f"({machine.world} ranks)")
    print(f"layout: {_describe(lay)}; per rank (pipeline stage {plan.stage}, {plan.params_per_rank / 1e9:.3g}B "
          "parameters):")
    print(plan.table())
    if time is not None:
        print(f"step time ({time.source}):")
        print(time.table())
    else:
        print("step time: this machine has no rates yet; `capstan plan --calibrate` measures them")
    if short or plan.problems:
        print("does not fit: " + "; ".join([*(f"{tier} short by {b / 1e9:.2f} GB per rank"
                                              for tier, b in short.items()),
                                            *plan.problems]))
        return 1
    print("fits")
    return 0


def _describe(lay: object) -> str:
    extra = f", cpu_budget {lay.cpu_budget / 2**20:.0f} MiB" if lay.offload == "disk" and lay.cpu_budget else ""
    cp = f" x cp {lay.cp} ({lay.cp_mode})" if lay.cp > 1 else ""
    tile = f", MLP tiles of {lay.mlp_tile}" if lay.mlp_tile else ""
    return (f"dp {lay.dp} x tp {lay.tp} x pp {lay.pp}{cp}, ZeRO {lay.zero_stage}, offload {lay.offload}{extra}{tile}, "
            f"{lay.precision}, micro {lay.micro} x accum {lay.accum}{', recompute' if lay.recompute else ''}")


def _search(args: argparse.Namespace, shape: object, machine: object, layout: object, local: bool) -> int:
    from ..plan import PlanError, search

    batch = args.global_batch or layout.micro * layout.accum * (layout.dp or machine.world // (layout.tp * layout.pp
                                                                                              * layout.cp))
    if batch < 1:
        raise PlanError(f"--global-batch {batch}: must be a positive number of sequences")
    result = search(shape, machine, batch, layout, measure=local, top=max(1, args.top))
    if args.json:
        sys.stdout.write(json.dumps({
            "tried": result.tried, "fitting": result.fitting, "missing": result.missing,
            "devices_needed": result.devices_needed, "skipped": list(result.skipped),
            "ranked": [{"layout": asdict(c.layout), "tokens_per_s": c.time.tokens_per_s, "step_s": c.time.seconds,
                        "bottleneck": c.time.bottleneck,
                        "total": {t: c.memory.total(t) for t in ("device", "ram", "disk")}}
                       for c in result.ranked[: args.top]]}) + "\n")
        return 0 if result.ranked else 1
    print(f"{shape.params / 1e6:.1f}M parameters, global batch {batch} x {shape.seq} tokens, on {machine.name} "
          f"({machine.world} ranks): {result.fitting} of {result.tried} layouts fit")
    for line in result.skipped:
        print(line)
    for k, c in enumerate(result.ranked[: args.top], 1):
        mem = ", ".join(f"{t} {c.memory.total(t) / 2**20:.0f} MiB"
                        for t in ("device", "ram", "disk") if c.memory.total(t))
        print(f"{k:3d}. {c.time.tokens_per_s:10,.0f} tokens/s  {_describe(c.layout)}  [{mem}; {c.time.bottleneck}]")
    if not result.ranked:
        need = "; ".join(f"{tier} short by at least {b / 1e9:.2f} GB per rank" for tier, b in result.missing.items())
        more = f"; the model states alone need {result.devices_needed} devices" if result.devices_needed else ""
        print(f"no layout fits: {need or 'nothing to try'}{more}")
        return 1
    return 0


def _calibrate(args: argparse.Namespace, shape: object, layout: object) -> int:
    from ..plan import save_machine
    from ..plan.calibrate import calibrate, default_machine_path

    shapes = []
    if shape is not None:  # the config's layout, and its tp = 1 / 2 variants for the search
        for tp in sorted({layout.tp, 1, 2}):
            if shape.heads % tp == 0:
                shapes.append((shape, replace(layout, tp=tp, dp=0)))
    quick = {"ranks": (2,), "disk_bytes": 32 << 20, "bf16_micro": 1, "bf16_pairs": 3} if args.quick else {}
    machine = calibrate(args.disk_dir, shapes=shapes, log=lambda s: print(s, flush=True), **quick)
    out = args.out or str(default_machine_path())
    save_machine(machine, out)
    r = machine.rates
    print(f"wrote {out}: {r.threads} thread(s) per rank on {r.cores} cores; block {r.flops['fp32'] / 1e9:.0f} "
          f"GFLOP/s fp32, {r.flops['bf16'] / 1e9:.0f} bf16; memory {r.memory_bandwidth / 1e9:.1f} GB/s; AdamW "
          f"{r.adam['fp32'] / 1e6:.0f} M params/s; disk read {r.disk_read / 1e9:.2f} / write {r.disk_write / 1e9:.2f} "
          f"GB/s; all-reduce of 2 ranks {r.collective[2].bandwidth / 1e9:.1f} GB/s "
          f"+ {r.collective[2].latency * 1e6:.0f} us")
    return 0
