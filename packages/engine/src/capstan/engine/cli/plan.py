"""`capstan plan`: the memory a model x machine x layout needs per rank and tier, before a run.

    capstan plan --model mt-nlg-530b --machine dgx-a100-80gb --nodes 35 --tp 8 --pp 35 --precision bf16 --recompute
    capstan plan --config examples/offload.toml            # the [model] and layout of a capstan config
    capstan plan --layers 40 --hidden 5120 --heads 40 --vocab 51200 --seq 1024 --machine v100-32gb --offload cpu

Exit 0 when it fits, 1 when a tier is short (the line says by how much), 2 for bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

__all__ = ["add_parser", "cmd_plan"]


def add_parser(sub: argparse._SubParsersAction) -> None:
    from ..plan import DEVICES, MODELS, NODES

    p = sub.add_parser("plan", help="the memory per rank and tier a model x machine x layout needs (docs/plan.md)")
    m = p.add_argument_group("model (a preset, a capstan config's [model], or sizes)")
    m.add_argument("--model", help=f"a preset: {', '.join(MODELS)}")
    m.add_argument("--config", help="a capstan config: its [model] and its layout ([parallel], [memory], [train], "
                                   "[precision]); flags below override")
    for name in ("layers", "hidden", "heads", "vocab", "seq"):
        m.add_argument(f"--{name}", type=int)
    mach = p.add_argument_group("machine")
    mach.add_argument("--machine", default="local",
                      help=f"a node ({', '.join(NODES)}), a device ({', '.join(DEVICES)}, with --devices-per-node "
                           "and --host-ram), or local (this machine, CPU ranks; default)")
    mach.add_argument("--nodes", type=int, default=1)
    mach.add_argument("--devices-per-node", type=int)
    mach.add_argument("--ranks-per-node", type=int, help="CPU ranks per node (a CPU machine)")
    mach.add_argument("--host-ram", help="RAM per node, e.g. 256GB")
    mach.add_argument("--disk", help="free disk per node for offload, e.g. 2TB")
    lay = p.add_argument_group("layout (docs/config.md names)")
    for name in ("dp", "tp", "pp", "zero-stage", "micro", "accum", "virtual-stages"):
        lay.add_argument(f"--{name}", type=int)
    lay.add_argument("--offload", choices=("none", "cpu", "disk"))
    lay.add_argument("--precision", choices=("fp32", "bf16", "fp16"))
    lay.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"))
    lay.add_argument("--recompute", action="store_true", default=None, help="activation checkpointing")
    lay.add_argument("--sequence-parallel", action="store_true", default=None)
    lay.add_argument("--cpu-budget", help="bytes of chunks in RAM (offload disk), e.g. 64GB")
    lay.add_argument("--gpu-budget", help="bytes of chunks on the device")
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


def _from_config(path: str) -> tuple[dict, dict]:
    """(model sizes, layout fields) of a capstan config file."""
    from ..config.load import load_config

    cfg = load_config(path)
    m, p, mem, t = cfg.model, cfg.parallel, cfg.memory, cfg.train
    shape = {"layers": m.n_layers, "hidden": m.d_model, "heads": m.n_heads, "vocab": m.vocab_size, "seq": m.seq_len}
    layout = {"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero_stage, "offload": mem.offload,
              "micro": t.micro_batch_size, "accum": t.grad_accum_steps, "recompute": mem.activation_checkpointing,
              "precision": cfg.precision.dtype, "sequence_parallel": p.sequence_parallel, "schedule": p.schedule,
              "virtual_stages": p.virtual_stages, "dropout": m.dropout > 0, "cpu_budget": mem.cpu_budget,
              "gpu_budget": mem.gpu_budget, "bucket_bytes": int(p.bucket_mb * 2**20)}
    return shape, layout


def cmd_plan(args: argparse.Namespace) -> int:
    from ..plan import MODELS, Layout, ModelShape, PlanError, machine_preset, memory_plan

    shape_kw: dict = {}
    layout_kw: dict = {}
    if args.config:
        shape_kw, layout_kw = _from_config(args.config)
    if args.model:
        if args.model not in MODELS:
            raise PlanError(f"unknown model preset {args.model!r}: expected one of {', '.join(MODELS)}")
        preset = MODELS[args.model]
        shape_kw = {k: getattr(preset, k) for k in ("layers", "hidden", "heads", "vocab", "seq")}
    for k in ("layers", "hidden", "heads", "vocab", "seq"):
        if getattr(args, k) is not None:
            shape_kw[k] = getattr(args, k)
    missing = [k for k in ("layers", "hidden", "heads", "vocab", "seq") if k not in shape_kw]
    if missing:
        raise PlanError(f"no model: give --model, --config, or all of --layers --hidden --heads --vocab --seq "
                        f"(missing {', '.join('--' + k for k in missing)})")
    shape = ModelShape(**shape_kw, name=args.model or "")
    for k in ("dp", "tp", "pp", "zero_stage", "micro", "accum", "virtual_stages", "offload", "precision", "schedule",
              "recompute", "sequence_parallel"):
        if getattr(args, k) is not None:
            layout_kw[k] = getattr(args, k)
    for k in ("cpu_budget", "gpu_budget"):
        if getattr(args, k) is not None:
            layout_kw[k] = _size(getattr(args, k), "--" + k.replace("_", "-"))
    machine_kw: dict = {}
    for k in ("devices_per_node", "ranks_per_node"):
        if getattr(args, k) is not None:
            machine_kw[k] = getattr(args, k)
    for k in ("host_ram", "disk"):
        if getattr(args, k) is not None:
            machine_kw[k] = _size(getattr(args, k), "--" + k.replace("_", "-"))
    if args.machine in ("local", "this") and "ranks_per_node" not in machine_kw:
        layout_probe = Layout(**{k: v for k, v in layout_kw.items()})
        machine_kw["ranks_per_node"] = (layout_probe.dp or 1) * layout_probe.tp * layout_probe.pp
    machine = machine_preset(args.machine, nodes=args.nodes, **machine_kw)
    plan = memory_plan(shape, machine, Layout(**layout_kw))
    short = plan.shortfall()
    if args.json:
        sys.stdout.write(json.dumps({
            "params": shape.params, "params_per_rank": plan.params_per_rank, "stage": plan.stage,
            "layout": {k: getattr(plan.layout, k) for k in plan.layout.__dataclass_fields__},
            "items": [{"what": i.what, "tier": i.tier, "bytes": i.bytes} for i in plan.items],
            "total": {t: plan.total(t) for t in ("device", "ram", "disk")},
            "capacity": plan.capacity, "fits": plan.fits, "short": short}) + "\n")
        return 0 if plan.fits else 1
    lay = plan.layout
    print(f"{shape.name or 'model'}: {shape.params / 1e9:.3g}B parameters ({shape.layers} x {shape.hidden}, "
          f"{shape.heads} heads, vocab {shape.vocab}, seq {shape.seq}) on {machine.name} x {machine.nodes} "
          f"({machine.world} ranks)")
    print(f"layout: dp {lay.dp} x tp {lay.tp} x pp {lay.pp}, ZeRO {lay.zero_stage}, offload {lay.offload}, "
          f"{lay.precision}, micro {lay.micro} x accum {lay.accum}{', recompute' if lay.recompute else ''}; "
          f"per rank (pipeline stage {plan.stage}, {plan.params_per_rank / 1e9:.3g}B parameters):")
    print(plan.table())
    if short:
        print("does not fit: " + "; ".join(f"{tier} short by {b / 1e9:.2f} GB per rank" for tier, b in short.items()))
        return 1
    print("fits")
    return 0
