"""capstan plan: predict what a model x machine x layout needs, before running it (docs/plan.md).

This first part predicts memory per rank and per tier (memory.py) from a model's shape, a machine
(presets with their sources, spec.py) and a layout; step time and the layout search come next.
"""

from .memory import TIERS, Item, MemoryPlan, memory_plan, min_devices_for_states
from .spec import DEVICES, GB, MODELS, NODES, Device, Layout, Machine, ModelShape, PlanError, local_machine, machine_preset

__all__ = ["TIERS", "Item", "MemoryPlan", "memory_plan", "min_devices_for_states", "DEVICES", "GB", "MODELS", "NODES",
           "Device", "Layout", "Machine", "ModelShape", "PlanError", "local_machine", "machine_preset"]
