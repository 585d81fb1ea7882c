"""How fast a machine is: the rates the step-time model (time.py) divides by.

`Rates` comes from one of two places:

* **Measured** by `capstan plan --calibrate` on this machine (calibrate.py): the forward and
  backward time of each layer of the model at its shapes (profiled as vTrain profiles operators:
  the real layers, one rank, the threads a launched rank gets), the effective FLOP/s of a block
  for shapes not profiled, memory bandwidth, the optimizer's parameters per second, disk read and
  write, collectives and point-to-point under the launcher, how much slower compute gets when every
  core runs a rank, and a rank's resident memory before the model. Saved as JSON with the machine.
* **Stated** for the GPU presets (`gpu_rates`): the datasheet figures of spec.py times an
  efficiency that no run here has checked (GPU_MATMUL_EFFICIENCY), PCIe for host<->device copies,
  NVLink inside a node and InfiniBand across nodes, and for the node presets their NVMe drives'
  nominal rates (spec.NODES; a device preset has no disk rate). Those step times are estimates, not
  validated.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Link", "LayerCost", "Rates", "gpu_rates", "GPU_MATMUL_EFFICIENCY", "PCIE_BANDWIDTH", "HOST_ADAM"]

# A well-tuned GPT step keeps 40-55% of a GPU's dense 16-bit rate busy (Narayanan et al. 2021, table 1:
# 44-52% on A100 for 1-1000B GPTs; Korthikanti et al. 2022 report 54-56% with selective recompute).
GPU_MATMUL_EFFICIENCY = 0.45
PCIE_BANDWIDTH = 25e9  # B/s host<->device, PCIe 4.0 x16 in practice (32 GB/s nominal)
HOST_ADAM = 1.0e9  # parameters/s of a CPU Adam step on a server's cores (ZeRO-Offload's CPU-Adam class)


@dataclass(frozen=True)
class Link:
    """A collective or point-to-point transfer: latency + bytes / bandwidth (bus bandwidth for
    collectives, nccl-tests convention: an all-reduce moves 2(n-1)/n of the buffer per rank)."""

    latency: float
    bandwidth: float

    def seconds(self, wire_bytes: float, calls: int = 1) -> float:
        return calls * self.latency + wire_bytes / self.bandwidth if wire_bytes or calls else 0.0


@dataclass(frozen=True)
class LayerCost:
    """Seconds per micro-batch of one layer on one rank (its tensor-parallel collectives excluded)."""

    forward: float
    backward: float


@dataclass(frozen=True)
class Rates:
    source: str
    threads: int = 1  # torch threads per rank under the launcher
    cores: int = 0  # cores per node shared by the ranks (0: each rank has a device of its own)
    flops: dict[str, float] = field(default_factory=dict)  # precision -> FLOP/s of a block's work on one rank
    memory_bandwidth: float = 0.0  # B/s, one rank
    adam: dict[str, float] = field(default_factory=dict)  # fp32 / mixed (fused cast) / sumsq / host -> parameters/s
    disk_read: float = 0.0
    disk_write: float = 0.0
    collective: dict[int, Link] = field(default_factory=dict)  # ranks in the group -> all-reduce on one node
    gather: dict[int, Link] = field(default_factory=dict)  # ranks in the group -> all-gather on one node
    all_to_all: dict[int, Link] = field(default_factory=dict)  # ranks in the group -> all-to-all on one node
    inter_node: Link | None = None
    p2p: Link | None = None
    host_device: float = 0.0  # B/s host<->device (0: no device)
    contention: float = 1.0  # compute slowdown when every core runs a rank
    host_overhead: int = 0  # bytes a launched rank holds before the model (interpreter, torch, MPI); 0: Machine's
    runtime: dict[str, int] = field(default_factory=dict)  # overhead.py: first_compute, bf16, heavy (bytes)
    layout_overhead: dict[str, int] = field(default_factory=dict)  # memory.runtime_family -> bytes (calibrate.py)
    layout_slack: dict[str, float] = field(default_factory=dict)  # memory.runtime_family -> bytes per tensor byte
    per_access: float = 0.0  # seconds per chunk hook access (a parameter fetched through chunkmem)
    step_overhead: float = 0.0  # seconds per step of the engine's own work beyond layers and optimizer
    # seconds per parameter of compression's local work, measured (calibrate.py): "onebit", one 1-bit Adam
    # step's packing and update; "int8", one int8 collective's quantizing and dequantizing. Empty: modelled.
    compression: dict[str, float] = field(default_factory=dict)
    layers: dict[str, LayerCost] = field(default_factory=dict)  # profiled layer costs, by costs.layer_key

    def link(self, ranks: int, nodes: int = 1, op: str = "all_reduce") -> Link:
        """The link of a collective (`op`: all_reduce, all_gather, all_to_all) over `ranks` spread on `nodes`
        nodes; the all-reduce's where the op was not measured (a machine file from before it was)."""
        if nodes > 1 and self.inter_node is not None:
            return self.inter_node
        table = {"all_gather": self.gather, "all_to_all": self.all_to_all}.get(op) or self.collective
        if ranks in table:
            return table[ranks]
        if not table:
            raise ValueError(f"no collective rates for {ranks} ranks ({self.source})")
        return table[min(table, key=lambda n: (abs(n - ranks), -n))]

    def to_json(self) -> dict:
        out = asdict(self)
        for key in ("collective", "gather", "all_to_all"):
            out[key] = {str(k): asdict(v) for k, v in getattr(self, key).items()}
        return out

    @classmethod
    def from_json(cls, data: dict) -> Rates:
        data = dict(data)
        for key in ("collective", "gather", "all_to_all"):
            data[key] = {int(k): Link(**v) for k, v in data.get(key, {}).items()}
        for key in ("inter_node", "p2p"):
            if data.get(key) is not None:
                data[key] = Link(**data[key])
        data["layers"] = {k: LayerCost(**v) for k, v in data.get("layers", {}).items()}
        return cls(**data)


def gpu_rates(device_flops: float, device_bandwidth: float, intra: float, inter: float, devices: int,
              disk_read: float = 0.0, disk_write: float = 0.0, source: str = "") -> Rates:
    """Stated rates of a GPU node (module docstring): nothing here has run on such a machine."""
    peak = device_flops * GPU_MATMUL_EFFICIENCY
    near = {n: Link(5e-6 * n, intra or 1e11) for n in (2, 4, 8, 16) if n <= max(2, devices)}
    return Rates(source=source or "datasheet rates x GPU_MATMUL_EFFICIENCY (not measured)", threads=0, cores=0,
                 flops={"bf16": peak, "fp16": peak, "fp32": peak / 8},  # fp32 without TF32: 1/8 of the tensor rate
                 memory_bandwidth=device_bandwidth,
                 # flat buffers step on the device (fused AdamW reads and writes ~28 B per parameter);
                 # chunks on the host
                 adam={"fp32": device_bandwidth / 28, "sumsq": device_bandwidth / 4, "host": HOST_ADAM},
                 disk_read=disk_read, disk_write=disk_write, collective=near, all_to_all=near,
                 inter_node=Link(2e-5, inter) if inter else None, p2p=Link(1e-5, intra or 1e11),
                 host_device=PCIE_BANDWIDTH)
