"""capstan plan: predict what a model x machine x layout needs and how fast it steps, before running it,
and pick the layout (docs/plan.md).

* memory.py: memory per rank and per tier (device, RAM, disk), chunks as the engine packs them (chunks.py);
* time.py: step time part by part, the bottleneck named, from layer costs (costs.py: profiled or from
  FLOPs) and the machine's rates (rates.py: measured by calibrate.py, or stated for GPU presets);
* layout_search.py: every layout that fits, ranked by predicted tokens/s;
* run.py: the prediction beside a real run (`capstan train --plan`).
"""

from __future__ import annotations

from capstan.comm.lazy import lazy_attributes

# Each name's module, imported on first use (capstan.comm.lazy): spec.py's presets, which `capstan launch`
# builds its help from, need no torch; memory.py's chunk lists do.
_MODULE_NAMES = {
    "memory": ("TIERS", "Item", "MemoryPlan", "memory_plan", "min_devices_for_states"),
    "rates": ("LayerCost", "Link", "Rates"),
    "layout_search": ("Candidate", "SearchResult", "search"),
    "spec": ("DEVICES", "GB", "MODELS", "NODES", "Device", "Layout", "Machine", "ModelShape", "PlanError",
             "load_machine", "local_machine", "machine_preset", "save_machine"),
    "time": ("StepTime", "step_time"),
}
_LAZY = {name: module for module, names in _MODULE_NAMES.items() for name in names}
__all__ = sorted(_LAZY)

__getattr__ = lazy_attributes(__name__, _LAZY)
