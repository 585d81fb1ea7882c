"""Split a sequence of layers into pipeline stages, building only the layers a rank owns.

A model is a list of `LayerSpec`s: a factory that builds one layer, and
optionally the key of a weight it shares with another layer (the tied
embedding / LM head). Parameter counts and class names come from building the
layer on ``torch.device("meta")``: no memory is allocated, so a rank can plan
the whole model and then build only its own stage (`Partition.build`).

Methods (`partition(specs, parts, method)`):

- ``"uniform"``: the same number of layers per stage (the first stages take the remainder);
- ``"parameters"``: contiguous stages minimizing the largest parameter count;
- ``"flops"``: contiguous stages minimizing the largest forward FLOP count, each
  layer's counted by ``torch.utils.flop_counter`` on ``example`` (the first
  layer's input, e.g. a micro-batch of token ids) fed through the layers in
  order, on the meta device (no memory, no compute) for layers built there. Parameters
  and compute part ways at the ends of a language model: the embedding holds
  vocab x d parameters and computes nothing, the LM head holds as many and
  computes 2 d vocab FLOPs per token, so a "parameters" split overloads the
  last stage;
- ``"time"``: contiguous stages minimizing the largest measured time: each layer
  is built for real, one at a time, and its forward + backward on ``example``
  (then on the previous layer's output) is timed (`layer_times`). Neither
  parameters nor FLOPs are time: a small-vocabulary head can cost less than a
  block although it counts more FLOPs, a large one much more. Timings differ
  between processes, so with ``group`` the group's first member measures and
  broadcasts the times, and every member gets the same boundaries;
- ``"type:<regex>"``: balance the layers whose class name matches (e.g. ``"type:Block"``),
  as DeepSpeed's ``partition_method="type:..."`` does;
- a list of boundaries ``[0, b1, ..., len(specs)]``: explicit.

With interleaving, partition into ``stages * chunks`` parts; stage s holds
parts c * stages + s for c in range(chunks) (`Partition.stage_parts`).

Example::

    from capstan.pipeline import partition
    from capstan.pipeline.testing_models import gpt_specs
    plan = partition(gpt_specs(vocab=256, hidden=64, layers=6), 2, "parameters")
    print(plan.summary())
    chunk = plan.build(0, seed=0)     # an nn.Sequential of stage 0's layers only
"""

from __future__ import annotations

import re
import statistics
import time
import zlib
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import torch
from torch import nn

__all__ = ["LayerSpec", "Partition", "PartitionError", "partition", "build_layers", "tie_layers", "layer_flops",
           "layer_times", "agreed_layer_times", "balanced_bounds"]


class PartitionError(ValueError):
    """A partition request that cannot be satisfied (names the method and the numbers)."""


@dataclass(frozen=True, eq=False)
class LayerSpec:
    """One layer: `factory()` builds it; `tied` names a weight shared with other layers."""

    factory: Callable[[], nn.Module]
    name: str = ""
    # Layers with the same `tied` key share their parameter `tied_attr` (e.g. "weight").
    tied: str | None = None
    tied_attr: str = "weight"
    _meta: dict = field(default_factory=dict, repr=False, compare=False)

    def _on_meta(self) -> nn.Module:
        if "module" not in self._meta:
            with torch.device("meta"):
                self._meta["module"] = self.factory()
        return self._meta["module"]

    @cached_property
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self._on_meta().parameters())

    @cached_property
    def type_name(self) -> str:
        return type(self._on_meta()).__name__


def _layer_seed(seed: int, index: int) -> int:
    # Every layer gets its own stream so a stage builds its layers exactly as the whole model would.
    return zlib.crc32(f"{seed}:{index}".encode())


def build_layers(
    specs: Sequence[LayerSpec], indices: Sequence[int], seed: int | None = None
) -> list[nn.Module]:
    """Build the layers at `indices`, seeded per layer (independent of which others are built)."""
    out = []
    for i in indices:
        if seed is None:
            out.append(specs[i].factory())
            continue
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(_layer_seed(seed, i))
            out.append(specs[i].factory())
    return out


def layer_flops(specs: Sequence[LayerSpec], example: torch.Tensor) -> list[int]:
    """Forward FLOPs of each layer (torch.utils.flop_counter: matmuls, convolutions, attention), the
    first fed `example`, each next one the previous output. Layers that build on the meta device run
    there (shapes only); a spec whose factory returns an already-built module runs it for real, once,
    without gradients."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    x, out = example, []
    for spec in specs:
        layer = spec._on_meta()
        on_meta = all(t.is_meta for t in layer.parameters())  # (a layer without parameters: True)
        x = x.to("meta") if on_meta else (torch.zeros(x.shape, dtype=x.dtype) if x.is_meta else x)
        # The math attention backend (as on meta): the counter sees its matmuls, not a fused CPU kernel.
        with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            x = layer(x)
        out.append(int(counter.get_total_flops()))
    return out


def layer_times(specs: Sequence[LayerSpec], example: torch.Tensor, repeats: int = 3) -> list[float]:
    """Seconds of forward + backward of each layer: built for real one at a time (and dropped before
    the next), the first fed `example`, each next one the previous output; a floating-point output is
    back-propagated with a gradient of ones. The median of `repeats` runs after one warm-up run.
    Nothing the caller holds changes: its random state (building and dropout draw from a forked
    one), and the gradients and buffers of a module a factory returns already built. Only the
    measuring rank runs this; afterwards it must be in the same state as the other ranks."""
    with torch.random.fork_rng(devices=[]):
        return _timed_chain(specs, example, repeats)


def _timed_chain(specs: Sequence[LayerSpec], example: torch.Tensor, repeats: int) -> list[float]:
    x, out = example, []
    for spec in specs:
        layer = spec.factory()
        # A factory may return a module already built and shared with the caller (an nn.Sequential's
        # child): its gradients and buffers (running statistics) are put back after the timing.
        grads = [(p, p.grad) for p in layer.parameters()]
        for p, _ in grads:
            p.grad = None  # the timing's gradients go to fresh tensors, the caller's stay untouched
        buffers = [(b, b.detach().clone()) for b in layer.buffers()]
        inp = x.detach().requires_grad_(x.is_floating_point())

        def once(layer: nn.Module = layer, inp: torch.Tensor = inp) -> torch.Tensor:  # this iteration's
            inp.grad = None
            y = layer(inp)
            if y.requires_grad:
                y.backward(torch.ones_like(y))
            return y

        y, times = once(), []
        for _ in range(repeats):
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
        out.append(statistics.median(times))
        with torch.no_grad():
            for p, g in grads:
                p.grad = g
            for b, saved in buffers:
                b.copy_(saved)
        x = y.detach()
        del layer, inp, y, grads, buffers, once  # once holds this layer (its defaults): one alive at a time
    return out


def agreed_layer_times(specs: Sequence[LayerSpec], example: torch.Tensor, group=None) -> list[float]:
    """`layer_times` measured by the first member of `group` (a capstan.comm group; None: this
    process alone) and broadcast, so every member gets the same values and splits alike."""
    from capstan import comm

    times = torch.zeros(len(specs), dtype=torch.float64)
    if group is None or group.rank == 0:
        times = torch.tensor(layer_times(specs, example), dtype=torch.float64)
    if group is not None:
        comm.broadcast(times, src=0, group=group)
    return times.tolist()


def balanced_bounds(weights: Sequence[float], parts: int) -> tuple[int, ...]:
    """Boundaries of `parts` non-empty contiguous groups of layers minimizing the largest sum of
    `weights` (parameter counts, FLOPs, or any per-layer cost known in closed form)."""
    if len(weights) < parts:
        raise PartitionError(f"cannot split {len(weights)} layers into {parts} non-empty parts")
    return tuple(_min_max_split(list(weights), parts))


def _min_max_split(weights: list[int], parts: int) -> list[int]:
    """Bounds of `parts` non-empty contiguous groups minimizing the largest sum (DP, O(p n^2))."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    inf = float("inf")
    # best[k][i]: smallest possible maximum when the first i layers form k groups.
    best = [[inf] * (n + 1) for _ in range(parts + 1)]
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n - (parts - k) + 1):
            for j in range(k - 1, i):
                cost = max(best[k - 1][j], prefix[i] - prefix[j])
                # `<=` prefers later cuts among equals, keeping early stages (embedding) light.
                if cost <= best[k][i]:
                    best[k][i], cut[k][i] = cost, j
    bounds = [n]
    for k in range(parts, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return bounds[::-1]


@dataclass(frozen=True)
class Partition:
    """Layer boundaries of every part: part i holds specs[bounds[i]:bounds[i+1]]."""

    specs: tuple[LayerSpec, ...]
    bounds: tuple[int, ...]
    method: str

    @property
    def parts(self) -> int:
        return len(self.bounds) - 1

    def layers(self, part: int) -> range:
        return range(self.bounds[part], self.bounds[part + 1])

    def parameters(self, part: int) -> int:
        return sum(self.specs[i].num_parameters for i in self.layers(part))

    def stage_parts(self, stage: int, stages: int) -> list[int]:
        """Parts held by `stage` when parts are dealt round-robin over `stages` (interleaving)."""
        if self.parts % stages:
            raise PartitionError(f"{self.parts} parts cannot be dealt over {stages} stages")
        return list(range(stage, self.parts, stages))

    def tied_parts(self) -> dict[str, list[int]]:
        """For every tied key, the parts that hold a layer with it (in order)."""
        owners: dict[str, list[int]] = {}
        for part in range(self.parts):
            for i in self.layers(part):
                key = self.specs[i].tied
                if key is not None and part not in owners.setdefault(key, []):
                    owners[key].append(part)
        return owners

    def build(self, part: int, seed: int | None = None) -> nn.Sequential:
        """Build only this part's layers as an nn.Sequential (child names: global layer indices)."""
        idx = list(self.layers(part))
        return nn.Sequential(
            OrderedDict(
                zip((str(i) for i in idx), build_layers(self.specs, idx, seed), strict=True)
            )
        )

    def summary(self) -> str:
        """A per-part table: layer range, layer type counts and parameters."""
        total = sum(s.num_parameters for s in self.specs) or 1
        lines = [f"partition ({self.method}) of {len(self.specs)} layers into {self.parts} parts:"]
        for part in range(self.parts):
            r = self.layers(part)
            kinds: dict[str, int] = {}
            for i in r:
                kinds[self.specs[i].type_name] = kinds.get(self.specs[i].type_name, 0) + 1
            what = ", ".join(f"{n}x{k}" for k, n in kinds.items())
            n = self.parameters(part)
            lines.append(
                f"  part {part}: layers {r.start}..{r.stop - 1} ({what}): {n:,} parameters "
                f"({100 * n / total:.1f}%)"
            )
        return "\n".join(lines)


def partition(
    specs: Sequence[LayerSpec], parts: int, method: str | Sequence[int] = "parameters",
    example: torch.Tensor | None = None, group=None,
) -> Partition:
    """Split `specs` into `parts` non-empty contiguous parts by `method` (see the module doc);
    `example` is the first layer's input, needed by ``"flops"`` and ``"time"``; `group` (a
    capstan.comm group, ``"time"`` only) makes its first member's timings everyone's."""
    specs = tuple(specs)
    n = len(specs)
    if parts < 1:
        raise PartitionError(f"parts must be positive, got {parts}")
    if n < parts:
        raise PartitionError(f"cannot split {n} layers into {parts} non-empty parts")
    if not isinstance(method, str):
        bounds = [int(b) for b in method]
        if (
            len(bounds) != parts + 1
            or bounds[0] != 0
            or bounds[-1] != n
            or any(a >= b for a, b in zip(bounds, bounds[1:], strict=False))
        ):
            raise PartitionError(
                f"explicit boundaries {bounds} must rise strictly from 0 to {n} "
                f"in {parts + 1} entries"
            )
        return Partition(specs, tuple(bounds), "explicit")
    if method == "uniform":
        base, extra = divmod(n, parts)
        bounds = [0]
        for k in range(parts):
            bounds.append(bounds[-1] + base + (1 if k < extra else 0))
        return Partition(specs, tuple(bounds), method)
    if method == "parameters":
        return Partition(
            specs, tuple(_min_max_split([s.num_parameters for s in specs], parts)), method
        )
    if method == "flops":
        if example is None:
            raise PartitionError("partition method 'flops' needs `example`, the first layer's input "
                                 "(e.g. a micro-batch of token ids)")
        return Partition(specs, balanced_bounds(layer_flops(specs, example), parts), method)
    if method == "time":
        if example is None:
            raise PartitionError("partition method 'time' needs `example`, the first layer's input "
                                 "(e.g. a micro-batch of token ids)")
        return Partition(specs, balanced_bounds(agreed_layer_times(specs, example, group), parts), method)
    if method.startswith("type:"):
        pattern = re.compile(method[5:])
        weights = [1 if pattern.search(s.type_name) else 0 for s in specs]
        if sum(weights) < parts:
            names = sorted({s.type_name for s in specs})
            raise PartitionError(
                f"{method!r} matches {sum(weights)} layers, fewer than {parts} parts "
                f"(layer types: {names})"
            )
        # Deal the matching layers as evenly as possible (the first parts take the remainder); each
        # part after the first starts at its first matching layer, so the layers in between (norms,
        # the embedding before the first block) stay with the preceding part.
        matched = [i for i, w in enumerate(weights) if w]
        base, extra = divmod(len(matched), parts)
        bounds, taken = [0], 0
        for k in range(parts - 1):
            taken += base + (1 if k < extra else 0)
            bounds.append(matched[taken])
        bounds.append(n)
        return Partition(specs, tuple(bounds), method)
    raise PartitionError(
        f"unknown partition method {method!r}; expected 'uniform', 'parameters', 'flops', 'time', 'type:<regex>' "
        f"or a list of boundaries"
    )


def tie_layers(specs: Sequence[LayerSpec], layers: Sequence[nn.Module]) -> None:
    """In one process, make layers with the same tied key share one Parameter (the first one's)."""
    first: dict[str, nn.Parameter] = {}
    for spec, layer in zip(specs, layers, strict=True):
        if spec.tied is None:
            continue
        if spec.tied in first:
            setattr(layer, spec.tied_attr, first[spec.tied])
        else:
            first[spec.tied] = getattr(layer, spec.tied_attr)
