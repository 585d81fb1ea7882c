"""capstan plan: predict what a model x machine x layout needs and how fast it steps, before running it,
and pick the layout (docs/plan.md).

* memory.py: memory per rank and per tier (device, RAM, disk), chunks as the engine packs them (chunks.py);
* time.py: step time part by part, the bottleneck named, from layer costs (costs.py: profiled or from
  FLOPs) and the machine's rates (rates.py: measured by calibrate.py, or stated for GPU presets);
* search.py: every layout that fits, ranked by predicted tokens/s;
* run.py: the prediction beside a real run (`capstan train --plan`).
"""

from .memory import TIERS, Item, MemoryPlan, memory_plan, min_devices_for_states
from .rates import LayerCost, Link, Rates
from .search import Candidate, SearchResult, search
from .spec import (
                   DEVICES,
                   GB,
                   MODELS,
                   NODES,
                   Device,
                   Layout,
                   Machine,
                   ModelShape,
                   PlanError,
                   load_machine,
                   local_machine,
                   machine_preset,
                   save_machine,
)
from .time import StepTime, step_time

__all__ = ["TIERS", "Item", "MemoryPlan", "memory_plan", "min_devices_for_states", "LayerCost", "Link", "Rates",
           "Candidate", "SearchResult", "search", "DEVICES", "GB", "MODELS", "NODES", "Device", "Layout", "Machine",
           "ModelShape", "PlanError", "load_machine", "local_machine", "machine_preset", "save_machine", "StepTime",
           "step_time"]
