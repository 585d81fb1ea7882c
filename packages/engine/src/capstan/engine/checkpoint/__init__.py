"""Universal checkpoints: `store` saves and loads them atomically under any layout, `format` is the
file format (safetensors shards + a manifest), `state` maps a rank's training state to layout-free
names, and `tools` inspects and exports (``capstan checkpoint inspect|export``). docs/checkpoints.md.
"""

from .store import (
    CheckpointError,
    assemble,
    checkpoint_dir,
    complete_checkpoints,
    incomplete_checkpoints,
    latest,
    load,
    load_latest,
    piece_index,
    read_manifest,
    save,
)

__all__ = ["CheckpointError", "assemble", "checkpoint_dir", "complete_checkpoints", "incomplete_checkpoints",
           "latest", "load", "load_latest", "piece_index", "read_manifest", "save"]
