"""`capstan checkpoint inspect DIR` and `capstan checkpoint export DIR OUT`.

inspect: the layout, step, parameter count and shard files of a checkpoint,
each file's SHA-256 checked against the manifest (a mismatch is an error
naming the file).

export: one consolidated safetensors file of the full, unsliced fp32
parameters under their one-process names (what `torch.load`-free tools and
`safetensors.torch.load_file` read), plus ``<OUT stem>.config.json`` with the
model config and the step. Streamed tensor by tensor: the header is computed
from the manifest, then each parameter is assembled from its pieces, written
and dropped, so peak memory is about two copies of the largest parameter,
whatever the model's size.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .format import Entry, file_sha256, write_safetensors
from .store import CheckpointError, assemble, latest, piece_index, read_manifest

__all__ = ["inspect", "export", "format_inspect"]


def _find(path: str | Path) -> Path:
    directory = latest(path)
    if directory is None:
        raise CheckpointError(f"no complete checkpoint at {path}")
    return directory


def inspect(path: str | Path, verify: bool = True) -> dict:
    """A summary of the checkpoint at `path`; with `verify`, every shard's SHA-256 is checked."""
    directory = _find(path)
    manifest = read_manifest(directory)
    files = []
    for name, meta in sorted(manifest["files"].items()):
        entry = {"file": name, "rank": meta["rank"], "coord": meta["coord"], "bytes": meta["bytes"]}
        if verify:
            actual = file_sha256(directory / name)
            if actual != meta["sha256"]:
                raise CheckpointError(f"checkpoint shard {directory / name} is corrupt: SHA-256 {actual[:16]}... "
                                      f"differs from the manifest's {meta['sha256'][:16]}...")
            entry["sha256"] = "ok"
        files.append(entry)
    return {"dir": str(directory), "step": manifest["step"], "layout": manifest["layout"],
            "params": len(manifest["params"]), "numel": manifest["numel"],
            "bytes": sum(f["bytes"] for f in files), "files": files,
            "train_state": manifest["train_state"], "model": manifest["config"].get("model")}


def format_inspect(info: dict) -> str:
    lay = info["layout"]
    lines = [
        f"checkpoint {info['dir']}",
        f"  step {info['step']} (consumed samples {info['train_state']['consumed_samples']}, "
        f"optimizer step {info['train_state']['optimizer_step']})",
        f"  layout: world {lay['world_size']} = dp {lay['dp']} x tp {lay['tp']} x pp {lay['pp']}, "
        f"ZeRO stage {lay['zero_stage']}, offload {lay['offload']}, {lay['dtype']}",
        f"  {info['params']} parameters, {info['numel']:,} elements; {len(info['files'])} shard files, "
        f"{info['bytes']:,} bytes",
    ]
    for f in info["files"]:
        c = f["coord"]
        lines.append(f"    {f['file']}  rank {f['rank']} (dp {c['dp']}, pp {c['pp']}, tp {c['tp']})  "
                     f"{f['bytes']:,} bytes  sha256 {f.get('sha256', 'not checked')}")
    return "\n".join(lines)


def _entries(directory: Path, manifest: dict) -> list[Entry]:
    """One streamed entry per parameter (assembled from its pieces when written)."""
    index = piece_index(manifest)
    entries = []
    for name, desc in manifest["params"].items():
        pieces = index.get((name, "param"))
        if not pieces:
            raise CheckpointError(f"checkpoint {directory} has no values for {name}")
        entries.append(Entry(name, tuple(desc["shape"]), torch.float32,
                             lambda n=name, p=pieces: assemble(directory, manifest, p, n)))
    return entries


def export(path: str | Path, out: str | Path, fmt: str = "safetensors") -> Path:
    """Write the consolidated parameters of the checkpoint at `path` to `out`: one safetensors file, or
    with ``fmt="hf"`` a directory that transformers' ``from_pretrained`` loads (config.json and
    model.safetensors under the model's own names) for a checkpoint of a transformers model."""
    directory = _find(path)
    manifest = read_manifest(directory)
    if fmt == "hf":
        return _export_hf(directory, manifest, Path(out))
    if fmt != "safetensors":
        raise CheckpointError(f"export format {fmt!r}: expected \"safetensors\" or \"hf\"")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_safetensors(out, _entries(directory, manifest), {"format": "capstan-export", "step": str(manifest["step"])})
    config = {"step": manifest["step"], "model": manifest["config"].get("model"), "layout": manifest["layout"],
              "source": str(directory)}
    (out.parent / (out.stem + ".config.json")).write_text(json.dumps(config, indent=1) + "\n")
    return out


def _export_hf(directory: Path, manifest: dict, out: Path) -> Path:
    """config.json (the model's config and class) and model.safetensors (its own parameter names)."""
    hf = manifest.get("hf")
    if not hf:
        raise CheckpointError(f"checkpoint {directory} is not of a transformers model (its manifest has no \"hf\" "
                              "section): export --format hf needs a model passed to initialize() from transformers")
    out.mkdir(parents=True, exist_ok=True)
    config = {**hf["config"], "architectures": [hf["architecture"]], "torch_dtype": "float32"}
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    # The checkpoint names parameters as the transformers model does under any layout (checkpoint/state.py).
    write_safetensors(out / "model.safetensors", _entries(directory, manifest),
                      {"format": "pt", "step": str(manifest["step"])})
    return out
