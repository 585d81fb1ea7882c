"""What the planner is given: a model's shape, a machine, and a layout.

    shape = MODELS["mt-nlg-530b"]                         # or ModelShape(layers=..., hidden=..., ...)
    machine = machine_preset("dgx-a100-80gb", nodes=35)   # or Machine(...)
    layout = Layout(tp=8, pp=35, micro=1, accum=280, recompute=True, precision="bf16")

Every size is in bytes, every rate in bytes (or FLOP) per second. Presets name their source in
`source`; device memory is the nominal capacity in decimal GB as the vendor states it ("40 GB" =
40e9 bytes), which is close to what is usable once the CUDA context and the allocator have taken
theirs. Bad input raises `PlanError` with one line naming what is wrong.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path

from .rates import Rates, gpu_rates

__all__ = ["PlanError", "ModelShape", "Device", "Machine", "Layout", "MODELS", "DEVICES", "NODES",
           "machine_preset", "local_machine", "load_machine", "save_machine", "virtual_parts", "GB"]

GB = 10**9


class PlanError(ValueError):
    """An impossible model, machine or layout; the message is one line naming it."""


def _positive(owner: str, **values: float) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
            raise PlanError(f"{owner}.{name} = {value!r}: must be a positive number")


@dataclass(frozen=True)
class ModelShape:
    """A GPT-shaped transformer: capstan's reference GPT (tensorpar.modules.gpt) with these sizes. A model of
    your own with the same layer, hidden, head, vocabulary and sequence sizes has the same
    parameter count to within its norms and biases."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn_mult: int = 4
    name: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        _positive("model", layers=self.layers, hidden=self.hidden, heads=self.heads, vocab=self.vocab,
                  seq=self.seq, ffn_mult=self.ffn_mult)
        for key in ("layers", "hidden", "heads", "vocab", "seq", "ffn_mult"):
            if not isinstance(getattr(self, key), int):
                raise PlanError(f"model.{key} = {getattr(self, key)!r}: must be a whole number")
        if self.hidden % self.heads:
            raise PlanError(f"model.hidden = {self.hidden} is not divisible by model.heads = {self.heads}")

    def layer_params(self, tp: int = 1) -> list[int]:
        """Parameters of each layer of [embedding, block x layers, final norm, head] on one rank of a
        tensor-parallel group of `tp` (matrices and column biases sliced, norms and row biases not)."""
        from ..model.reference_gpt import layer_params

        return layer_params(self.layers, self.hidden, self.vocab, self.seq, self.ffn_mult, tp)

    @property
    def params(self) -> int:
        return sum(self.layer_params(1))


@dataclass(frozen=True)
class Device:
    """An accelerator: its memory and dense 16-bit matmul rate."""

    name: str
    memory: int
    flops: float
    memory_bandwidth: float
    source: str


@dataclass(frozen=True)
class Machine:
    """Nodes of `devices_per_node` accelerators (none: CPU ranks, `ranks_per_node` of them) with host
    RAM, disk and links. `overhead_per_rank`: memory every rank spends outside the model (the CUDA
    context and allocator reserve on a device; the interpreter and torch in RAM)."""

    name: str
    nodes: int = 1
    device: Device | None = None
    devices_per_node: int = 0
    ranks_per_node: int = 1
    host_ram: int = 0
    disk: int = 0
    disk_read: float = 0.0  # B/s one rank reads its disk tier at, all ranks streaming (0: unknown, no disk timing)
    disk_write: float = 0.0
    intra_bandwidth: float = 0.0
    inter_bandwidth: float = 0.0
    device_overhead: int = GB
    host_overhead: int = 400 * 10**6  # 400 MB: interpreter, torch and the native library per process
    source: str = ""
    rates: Rates | None = field(default=None, compare=False)  # how fast (rates.py); None: memory only

    def __post_init__(self) -> None:
        _positive("machine", nodes=self.nodes, host_ram=self.host_ram)
        if self.device is not None:
            _positive("machine", devices_per_node=self.devices_per_node)
        else:
            _positive("machine", ranks_per_node=self.ranks_per_node)

    @property
    def per_node(self) -> int:
        """Ranks per node: one per device, or `ranks_per_node` on a CPU machine."""
        return self.devices_per_node if self.device is not None else self.ranks_per_node

    @property
    def world(self) -> int:
        return self.nodes * self.per_node


@dataclass(frozen=True)
class Layout:
    """How a run is laid out (the same names as capstan's config: docs/config.md). dp = 0: the rest
    of the machine's ranks after tp x pp x cp. With cp > 1 a rank computes seq / cp tokens of each
    sequence, and gradients are reduced (ZeRO states sharded) over the dp x cp `replicas`."""

    dp: int = 0
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    offload: str = "none"
    micro: int = 1
    accum: int = 1
    recompute: bool = False
    precision: str = "fp32"
    optimizer_states: str = "fp32"  # precision.optimizer_states: Adam's moments in "fp32", "bf16" or "int8"
    master_weights: str = "fp32"  # precision.master_weights: "bf16" makes the bf16 parameters the master
    sequence_parallel: bool = False
    schedule: str = "1f1b"
    virtual_stages: int = 1
    dropout: bool = False
    cpu_budget: int | None = None
    gpu_budget: int | None = None
    bucket_bytes: int = 25 * 10**6
    chunk_size: int | None = None  # elements per chunk (None: chosen per model, as the engine does)
    eviction: str = "belady"
    grad_clip: bool = True
    overlap_optimizer: bool | None = None  # memory.overlap_optimizer (None: the engine's default, on past RAM)
    data_bytes: int = 0  # training text read into RAM (capstan's data.max_bytes for a text source)
    tiled_loss: bool = True  # memory.tiled_loss: the head's logits a tile at a time
    activation_offload: bool = False  # memory.activation_offload: recomputed blocks' inputs on disk (or host RAM)
    compression: str = "none"  # parallel.compression: "onebit" (1-bit Adam past its freeze) or "int8" (ZeRO++-style)
    cp: int = 1  # parallel.cp: context-parallel ranks per replica, each holding seq / cp of every sequence
    cp_mode: str = "ulysses"  # parallel.cp_mode: "ulysses" (all-to-all to head-split) or "ring" (key/value blocks)
    mlp_tile: int = 0  # memory.mlp_tile: tokens per recomputed tile of each block's MLP (0: off)

    @property
    def replicas(self) -> int:
        """Ranks that hold the same parameters and reduce gradients together (ZeRO shards over them): dp x cp."""
        return self.dp * self.cp

    def __post_init__(self) -> None:
        _positive("layout", tp=self.tp, pp=self.pp, cp=self.cp, micro=self.micro, accum=self.accum,
                  virtual_stages=self.virtual_stages)
        if self.mlp_tile < 0:
            raise PlanError(f"layout.mlp_tile = {self.mlp_tile}: must be 0 (off) or a positive number of tokens")
        if self.dp < 0:
            raise PlanError(f"layout.dp = {self.dp}: must be 0 (the rest of the ranks) or positive")
        if self.zero_stage not in (0, 1, 2, 3):
            raise PlanError(f"layout.zero_stage = {self.zero_stage}: expected 0, 1, 2 or 3")
        for key, allowed in (("offload", ("none", "cpu", "disk")), ("precision", ("fp32", "bf16", "fp16")),
                             ("optimizer_states", ("fp32", "bf16", "int8")), ("master_weights", ("fp32", "bf16")),
                             ("schedule", ("gpipe", "1f1b", "interleaved")),
                             ("compression", ("none", "onebit", "int8")), ("cp_mode", ("ulysses", "ring"))):
            if getattr(self, key) not in allowed:
                raise PlanError(f"layout.{key} = {getattr(self, key)!r}: expected one of {', '.join(allowed)}")
        flat = self.zero_stage != 3 and self.offload == "none"
        if self.master_weights == "bf16" and (self.precision != "bf16" or self.compression == "onebit" or (
                flat and self.compression == "int8")):
            raise PlanError("layout.master_weights = 'bf16' needs precision 'bf16', not 1-bit compression, nor int8 "
                            f"compression without chunks (got precision {self.precision!r}, zero_stage "
                            f"{self.zero_stage}, offload {self.offload!r}, compression {self.compression!r})")
        for key in ("cpu_budget", "gpu_budget"):
            if getattr(self, key) is not None:
                _positive("layout", **{key: getattr(self, key)})
        if self.compression == "onebit" and self.zero_stage != 0:
            raise PlanError("layout.compression = \"onebit\" (1-bit Adam) needs zero_stage 0 (offload replicates "
                            "the chunks on every dp rank)")
        if self.compression == "int8" and self.zero_stage == 0 and self.offload == "none":
            raise PlanError("layout.compression = \"int8\" compresses ZeRO's reduce-scatter and all-gather: it needs "
                            "zero_stage 1-3 or offload")
        if self.cp > 1 and self.dropout:
            raise PlanError("layout.cp > 1 needs dropout off (the engine's context parallelism has no dropout streams)")
        if self.activation_offload and not self.recompute:
            raise PlanError("layout.activation_offload moves recomputed blocks' inputs: it needs layout.recompute")
        if self.offload == "disk" and self.cpu_budget is None:
            raise PlanError("layout.offload = \"disk\" needs layout.cpu_budget (the bytes of chunks kept in RAM)")

    def resolved(self, shape: ModelShape, machine: Machine) -> Layout:
        """This layout with dp filled in, checked against the model and the machine."""
        world, fixed = machine.world, self.tp * self.pp * self.cp
        names, sizes = ("tp x pp x cp", f"{self.tp} x {self.pp} x {self.cp}") if self.cp > 1 else \
            ("tp x pp", f"{self.tp} x {self.pp}")
        if world % fixed:
            raise PlanError(f"layout {names} = {sizes} does not divide the machine's {world} ranks")
        dp = self.dp or world // fixed
        if dp * fixed != world:
            raise PlanError(f"layout dp x {names} = {dp} x {sizes} = {dp * fixed} ranks, but the machine has {world}")
        if shape.heads % self.tp:
            raise PlanError(f"model.heads = {shape.heads} is not divisible by layout.tp = {self.tp}")
        if self.tp > machine.per_node:
            raise PlanError(f"layout.tp = {self.tp} spans more than one node ({machine.per_node} ranks per node): "
                            "tensor-parallel groups stay on one node")
        parts = self.pp * self.virtual_stages
        if parts > shape.layers + 3:
            raise PlanError(f"layout pp x virtual_stages = {parts} parts, more than the model's {shape.layers + 3} "
                            "layers (embedding, blocks, norm, head)")
        if self.sequence_parallel and (self.tp == 1 or shape.seq % self.tp):
            raise PlanError(f"layout.sequence_parallel needs tp > 1 dividing model.seq = {shape.seq}")
        if self.cp > 1:  # capstan.tensorpar.context.check_context_sizes, kept torch-free here
            if self.cp_mode == "ulysses" and (shape.heads // self.tp % self.cp or shape.seq % self.cp):
                raise PlanError(f"layout.cp_mode = \"ulysses\" needs the heads per tp rank ({shape.heads // self.tp}) "
                                f"and model.seq ({shape.seq}) divisible by layout.cp = {self.cp}")
            if self.cp_mode == "ring" and shape.seq % (2 * self.cp):
                raise PlanError(f"layout.cp_mode = \"ring\" needs model.seq = {shape.seq} divisible by 2 x cp = "
                                f"{2 * self.cp}")
            if self.sequence_parallel and (shape.seq // self.cp) % self.tp:
                raise PlanError(f"layout.sequence_parallel needs tp = {self.tp} dividing a cp rank's "
                                f"{shape.seq // self.cp} tokens")
        return replace(self, dp=dp)


def virtual_parts(shape: ModelShape, layout: Layout) -> list[list[int]]:
    """Layer indices (into [embedding, blocks, norm, head]) of each of the pp x v virtual pipeline stages,
    split by parameter count as the engine's default `parallel.partition = "parameters"` does; stage s
    holds parts s, s + pp, s + 2 pp, ... (interleaved)."""
    n, parts = shape.layers + 3, layout.pp * layout.virtual_stages
    if parts == 1:
        return [list(range(n))]
    bounds = _bounds(shape, layout.tp, parts)  # part i is bounds[i]:bounds[i + 1]
    return [list(range(a, b)) for a, b in zip(bounds, bounds[1:])]


@lru_cache(maxsize=1024)
def _bounds(shape: ModelShape, tp: int, parts: int) -> tuple[int, ...]:
    """balanced_bounds of the layers' parameters: O(parts x layers^2), a second at 128 stages of gpt-1t, so
    computed once per shape (the search asks for the same split thousands of times)."""
    from capstan.pipeline.stages.partition import balanced_bounds

    return tuple(balanced_bounds(shape.layer_params(tp), parts))


def _model(layers: int, hidden: int, heads: int, vocab: int, seq: int, name: str, source: str) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, name=name, source=source)


MODELS = {m.name: m for m in (
    _model(24, 2048, 32, 51200, 2048, "gpt3-1.3b", "Brown et al. 2020, GPT-3 paper, table 2.1 (GPT-3 XL)"),
    _model(40, 5120, 40, 51200, 1024, "zero-offload-13b",
           "Ren et al. 2021, ZeRO-Offload (USENIX ATC), 13B trained on one 32 GB V100; the 40 x 5120 GPT "
           "of Megatron's 13B configuration"),
    _model(60, 4096, 16, 30522, 1024, "patrickstar-12b",
           "Fang et al. 2022, PatrickStar (IEEE TPDS), 12B on 8 x V100 with 240 GB host RAM; 60 x 4096 "
           "(Tencent/PatrickStar examples/model_builder.py, GPT3_12B)"),
    _model(96, 12288, 96, 51200, 2048, "gpt3-175b", "Brown et al. 2020, GPT-3 paper, table 2.1"),
    _model(105, 20480, 128, 51200, 2048, "mt-nlg-530b",
           "Smith et al. 2022, Megatron-Turing NLG 530B: 105 layers, hidden 20480, 128 heads; 8-way tensor "
           "x 35-way pipeline = 280 A100-80GB per replica"),
    _model(128, 25600, 160, 51200, 2048, "gpt-1t",
           "Narayanan et al. 2021, Efficient Large-Scale Language Model Training on GPU Clusters, table 1 "
           "(1008B: 128 layers, hidden 25600, 160 heads)"),
)}

DEVICES = {d.name: d for d in (
    Device("v100-32gb", 32 * GB, 125e12, 900e9,
           "NVIDIA V100 datasheet (SXM2): 32 GB HBM2, 900 GB/s, 125 TFLOPS tensor"),
    Device("a100-40gb", 40 * GB, 312e12, 1555e9,
           "NVIDIA A100 datasheet: 40 GB HBM2, 1555 GB/s, 312 TFLOPS BF16 dense"),
    Device("a100-80gb", 80 * GB, 312e12, 2039e9,
           "NVIDIA A100 datasheet (SXM): 80 GB HBM2e, 2039 GB/s, 312 TFLOPS BF16 dense"),
    Device("h100-80gb", 80 * GB, 989e12, 3350e9,
           "NVIDIA H100 datasheet (SXM): 80 GB HBM3, 3.35 TB/s, 989 TFLOPS BF16 dense"),
    Device("h200-141gb", 141 * GB, 989e12, 4800e9,
           "NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s, 989 TFLOPS BF16 dense"),
)}


@dataclass(frozen=True)
class _Node:
    device: str
    devices: int
    host_ram: int
    disk: int
    intra: float
    inter: float
    disk_read: float  # B/s of the node's NVMe RAID-0 (all drives together), sequential; shared by its ranks
    disk_write: float
    source: str = field(default="")


# Disk rates: the datasheets give the drives (count x 3.84 TB U.2 NVMe in RAID-0), not their speed. The
# rates are the drive class's sequential figures times the drive count, nominal (none measured here):
# PCIe 3.0 U.2 (DGX-2; e.g. Samsung PM983 3.84 TB: 3.2 GB/s read, 2.0 GB/s write) and PCIe 4.0 U.2
# (DGX A100 / H100; e.g. Samsung PM1733 3.84 TB: 7.0 GB/s read, 3.8 GB/s write). A rank gets its share.
_GEN3_READ, _GEN3_WRITE = 3.2e9, 2.0e9
_GEN4_READ, _GEN4_WRITE = 7.0e9, 3.8e9

NODES = {
    "dgx-2": _Node("v100-32gb", 16, 1500 * GB, 30_000 * GB, 300e9, 100e9, 8 * _GEN3_READ, 8 * _GEN3_WRITE,
                   "NVIDIA DGX-2 datasheet: 16 x V100-32GB, 1.5 TB RAM, 30 TB NVMe (8 x 3.84 TB), NVSwitch 300 GB/s "
                   "per GPU, 8 x 100 Gb/s InfiniBand; disk 25.6 / 16 GB/s read / write: 8 PCIe 3.0 U.2 drives in "
                   "RAID-0 at 3.2 / 2.0 GB/s each (Samsung PM983 class, nominal)"),
    "dgx-a100-40gb": _Node("a100-40gb", 8, 1000 * GB, 15_000 * GB, 600e9, 200e9, 4 * _GEN4_READ, 4 * _GEN4_WRITE,
                           "NVIDIA DGX A100 datasheet (320 GB system): 8 x A100-40GB, 1 TB RAM, 15 TB NVMe (4 x 3.84 "
                           "TB U.2), NVLink 600 GB/s, 8 x 200 Gb/s InfiniBand; disk 28 / 15.2 GB/s read / write: 4 "
                           "PCIe 4.0 U.2 drives in RAID-0 at 7.0 / 3.8 GB/s each (Samsung PM1733 class, nominal)"),
    "dgx-a100-80gb": _Node("a100-80gb", 8, 2000 * GB, 30_000 * GB, 600e9, 200e9, 8 * _GEN4_READ, 8 * _GEN4_WRITE,
                           "NVIDIA DGX A100 datasheet (640 GB system): 8 x A100-80GB, 2 TB RAM, 30 TB NVMe (8 x 3.84 "
                           "TB U.2), NVLink 600 GB/s, 8 x 200 Gb/s InfiniBand; disk 56 / 30.4 GB/s read / write: 8 "
                           "PCIe 4.0 U.2 drives in RAID-0 at 7.0 / 3.8 GB/s each (Samsung PM1733 class, nominal)"),
    "dgx-h100": _Node("h100-80gb", 8, 2000 * GB, 30_000 * GB, 900e9, 400e9, 8 * _GEN4_READ, 8 * _GEN4_WRITE,
                      "NVIDIA DGX H100 datasheet: 8 x H100-80GB, 2 TB RAM, 30 TB NVMe (8 x 3.84 TB U.2), NVLink 900 "
                      "GB/s, 8 x 400 Gb/s InfiniBand; disk 56 / 30.4 GB/s read / write: 8 PCIe 4.0 U.2 drives in "
                      "RAID-0 at 7.0 / 3.8 GB/s each (Samsung PM1733 class, nominal)"),
}


def machine_preset(name: str, nodes: int = 1, **overrides: object) -> Machine:
    """A preset node (NODES), one node of a preset device (DEVICES, host RAM from `overrides`), `local`
    (this machine, memory only), or a machine file written by `capstan plan --calibrate` (a path).

    A node's disk rates are its RAID-0's shared by the devices in use (every rank streams at once); a
    device preset has no disk and no disk rate (offload "disk" is not timed on it) unless `overrides`
    give `disk_read` and `disk_write` (bytes/s per rank), which the rates take too."""
    disk_rates = {k: float(overrides.pop(k)) for k in ("disk_read", "disk_write") if overrides.get(k) is not None}
    for k, v in disk_rates.items():
        if v <= 0:
            raise PlanError(f"machine.{k} = {v!r}: must be a positive number of bytes per second")
    if name in NODES:
        n = NODES[name]
        d = DEVICES[n.device]
        per = int(overrides.get("devices_per_node", n.devices))  # type: ignore[call-overload]
        read, write = n.disk_read / max(1, per), n.disk_write / max(1, per)
        base = Machine(name=name, nodes=nodes, device=d, devices_per_node=n.devices,
                       host_ram=n.host_ram, disk=n.disk, disk_read=read, disk_write=write, intra_bandwidth=n.intra,
                       inter_bandwidth=n.inter, source=n.source,
                       rates=gpu_rates(d.flops, d.memory_bandwidth, n.intra, n.inter, n.devices, read, write))
    elif name in DEVICES:
        d = DEVICES[name]
        per = int(overrides.pop("devices_per_node", 1))
        base = Machine(name=name, nodes=nodes, device=d, devices_per_node=per,
                       host_ram=int(overrides.pop("host_ram", 0)) or 256 * GB, source=d.source,
                       rates=gpu_rates(d.flops, d.memory_bandwidth, 0.0, 0.0, per))
    elif name in ("local", "this"):
        base = local_machine(nodes=nodes)
    elif name.endswith(".json") or os.sep in name:
        base = replace(load_machine(name), nodes=nodes)
    else:
        raise PlanError(f"unknown machine preset {name!r}: expected one of {', '.join([*NODES, *DEVICES, 'local'])}, "
                        "or a machine file from `capstan plan --calibrate`")
    try:
        machine = replace(base, **overrides)  # type: ignore[arg-type]
    except TypeError as exc:
        raise PlanError(f"machine preset {name!r}: {exc}") from None
    if disk_rates:
        rates = replace(machine.rates, **disk_rates) if machine.rates is not None else None
        machine = replace(machine, rates=rates, **disk_rates)
    return machine


def local_machine(nodes: int = 1, ranks_per_node: int | None = None) -> Machine:
    """This machine as a CPU machine: its RAM and core count (`capstan plan --calibrate` measures rates)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return Machine(name="local", nodes=nodes, ranks_per_node=ranks_per_node or 1, host_ram=ram,
                   source="this machine (os.sysconf)")


def save_machine(machine: Machine, path: str | os.PathLike) -> None:
    """Write a machine (a calibrated one: its rates and layer profiles too) as JSON."""
    data = {k: v for k, v in asdict(machine).items() if k not in ("rates", "device")}
    data["device"] = asdict(machine.device) if machine.device is not None else None
    data["rates"] = machine.rates.to_json() if machine.rates is not None else None
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(str(path) + ".partial")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    tmp.replace(path)


def load_machine(path: str | os.PathLike) -> Machine:
    """A machine file written by `save_machine` (`capstan plan --calibrate`); one line naming what is wrong."""
    try:
        data = json.loads(Path(path).read_text())
        data["device"] = Device(**data["device"]) if data.get("device") else None
        data["rates"] = Rates.from_json(data["rates"]) if data.get("rates") else None
        return Machine(**data)
    except FileNotFoundError:
        raise PlanError(f"machine file {path} does not exist: write it with `capstan plan --calibrate --out {path}`") \
            from None
    except (OSError, ValueError, TypeError, KeyError) as exc:
        raise PlanError(f"machine file {path} is not a capstan machine file: {exc}") from None
