"""capstan.pipeline: pipeline-parallel partitioning, schedules and their executor.

Schedules are data (`schedule/schedules.py`), checked by a simulator
(`schedule/simulate.py`) and drawn as ASCII timelines (`schedule/timeline.py`);
`stages/partition.py` splits a list of layer specs into stages without
allocating other stages' parameters; `runtime/executor.py` runs a schedule over
`capstan.comm` point-to-point. See docs/pipeline.md ("Layout": the rooms).
"""

from .runtime.executor import PipelineError, PipelineExecutor
from .schedule.instructions import (
    Backward,
    CommInstruction,
    ComputeInstruction,
    Forward,
    Instruction,
    LoadMicrobatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
)
from .schedule.schedules import (
    SCHEDULES,
    GPipe,
    Interleaved1F1B,
    OneFOneB,
    Schedule,
    ScheduleError,
    make_schedule,
)
from .schedule.simulate import Deadlock, SimResult, SimulationError, batches, simulate
from .schedule.timeline import render_timeline
from .stages.hf_layers import HF_PIPELINE_FAMILIES, HF_TIED_HEADS, hf_layer_specs, hf_param_name
from .stages.partition import (
    LayerSpec,
    Partition,
    PartitionError,
    agreed_layer_times,
    balanced_bounds,
    build_layers,
    layer_flops,
    layer_times,
    partition,
    tie_layers,
)

__all__ = [
    "HF_PIPELINE_FAMILIES", "HF_TIED_HEADS", "hf_layer_specs", "hf_param_name",
    "Backward",
    "CommInstruction",
    "ComputeInstruction",
    "Deadlock",
    "Forward",
    "GPipe",
    "Instruction",
    "Interleaved1F1B",
    "LayerSpec",
    "LoadMicrobatch",
    "Partition",
    "PartitionError",
    "PipelineError",
    "PipelineExecutor",
    "agreed_layer_times",
    "balanced_bounds",
    "build_layers",
    "layer_flops",
    "layer_times",
    "partition",
    "tie_layers",
    "OneFOneB",
    "OptimizerStep",
    "RecvActivation",
    "RecvGrad",
    "ReduceTiedGrads",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "SendActivation",
    "SendGrad",
    "SimResult",
    "SimulationError",
    "batches",
    "make_schedule",
    "render_timeline",
    "simulate",
]
