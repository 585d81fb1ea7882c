"""The training configuration: the typed sections (`schema`), their one strict loader (`load`) and the
generator of docs/config.md (`doc`, run as ``python -m capstan.engine.config.doc docs/config.md``).

Nothing here imports torch, so `capstan train` rejects a bad config in a fraction of a second.
"""

from .deepspeed import from_deepspeed, translate_deepspeed
from .load import ConfigError, Sources, check_world, load_config, parse_override, resolve, to_toml
from .schema import (
    SECTIONS,
    CheckpointConfig,
    Config,
    DataConfig,
    LogConfig,
    MemoryConfig,
    ModelConfig,
    ParallelConfig,
    PrecisionConfig,
    TrainConfig,
    constraint,
)

__all__ = [
    "SECTIONS", "CheckpointConfig", "Config", "ConfigError", "DataConfig", "LogConfig", "MemoryConfig",
    "ModelConfig", "ParallelConfig", "PrecisionConfig", "Sources", "TrainConfig", "check_world", "constraint",
    "from_deepspeed", "load_config", "parse_override", "resolve", "to_toml", "translate_deepspeed",
]
