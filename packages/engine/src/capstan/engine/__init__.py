"""capstan.engine: the trainer and the `capstan` command line.

    from capstan.engine import initialize
    engine = initialize(config="examples/tiny.toml")      # reference GPT, layout from the config
    data = open_data(engine.config)
    it = train_batches(data, engine.config, dp=engine.groups.dp.size, dp_rank=engine.groups.dp.rank)
    for _ in range(engine.config.train.steps):
        info = engine.train_batch(it)                      # info.loss: global mean over the batch

Or from the shell: ``capstan train --config examples/tiny.toml`` (docs/engine.md).
The config modules import no torch, so `capstan train` rejects a bad config
in a fraction of a second; the trainer is imported lazily.
"""

from __future__ import annotations

from capstan.comm.lazy import lazy_attributes

from .config import (
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    LogConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    check_world,
    load_config,
    resolve,
)

__all__ = [
    "CheckpointConfig", "Config", "ConfigError", "DataConfig", "DataError", "Engine", "LogConfig",
    "MemoryConfig", "ModelConfig", "ParallelConfig", "PrecisionConfig", "StepInfo", "TrainConfig",
    "check_world", "dataset_batches", "initialize", "load_config", "open_data", "resolve", "train_batches",
    "val_batches",
]

_LAZY = {"Engine": "engine", "StepInfo": "engine", "initialize": "build", "DataError": "data",
         "open_data": "data", "train_batches": "data", "val_batches": "data", "dataset_batches": "data"}

__getattr__ = lazy_attributes(__name__, _LAZY)
