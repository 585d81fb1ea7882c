"""Universal checkpoints: save under any layout, load under any other (format: format.py).

    engine.save("runs/x/checkpoints")        # every rank; writes step_<global step>/
    engine.load("runs/x/checkpoints")        # the newest complete one (or a step_* directory)

Saving is atomic. Every rank writes its shard and a small index into
``step_N.partial/`` (each file written under a temporary name, fsynced,
renamed); after a barrier rank 0 merges the indexes into ``manifest.json``
(fsynced), renames the directory to ``step_N`` and fsyncs the parent. A
directory without a manifest, or still named ``.partial``, is never loaded; a
crash at any point leaves the previous checkpoints as they were. Only after a
new one is complete are the oldest deleted down to ``checkpoint.keep``.

Loading reads the manifest, checks that every shard file has its recorded
size (truncation) and every piece its CRC-32 (corruption), and rebuilds each
of this rank's parameters and Adam moments from whichever pieces hold them
(state.py): a checkpoint of any (dp, tp, pp, ZeRO stage, offload) loads
under any other. The step, the Adam step count, the loss scaler and — when
the layout is unchanged — every rank's RNG states are restored too; the data
order is a function of the step (data/sources.py), so resuming at step k continues
with exactly the batches an uninterrupted run would see (bit-identical losses
in fp32). An error on any rank is reported on every rank.
"""

from __future__ import annotations

import json
import os
import shutil
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from capstan import comm
from capstan.comm.health import faults

from .format import DTYPE_CODES, FORMAT, MANIFEST, VERSION, Entry, fsync_dir, read_tensor, write_safetensors
from .state import FIELDS, LocalParam, merge_tp, rng_generators, slice_tp, state_view

if TYPE_CHECKING:  # annotations only: the engine imports this package (Engine.save / load)
    from ..engine import Engine

__all__ = ["save", "load", "load_latest", "latest", "checkpoint_dir", "CheckpointError", "read_manifest",
           "assemble", "incomplete_checkpoints"]

log = comm.get_logger(__name__)
PARTIAL = ".partial"


class CheckpointError(ValueError):
    """A checkpoint cannot be used (missing, incomplete, corrupt, or not matching the model)."""


def checkpoint_dir(engine: Engine, run_dir: Path) -> Path:
    d = Path(engine.config.checkpoint.dir)
    return d if d.is_absolute() else run_dir / d


def _layout(engine: Engine) -> dict[str, object]:
    cfg, g = engine.config, engine.groups
    return {"world_size": g.world.size, "dp": g.dp.size, "tp": g.tp.size, "pp": g.pp.size, "cp": g.cp.size,
            "zero_stage": cfg.parallel.zero_stage, "offload": cfg.memory.offload, "dtype": cfg.precision.dtype,
            "schedule": cfg.parallel.schedule, "virtual_stages": cfg.parallel.virtual_stages,
            "device": engine.device.type}


def _same_layout(saved: dict, engine: Engine) -> bool:
    """The saved layout is this run's (RNG states then continue exactly; a checkpoint written before
    the layout named its device was written on the CPU)."""
    return {"device": "cpu", "cp": 1, **saved} == _layout(engine)


def _write_json(path: Path, obj: object) -> None:
    tmp = path.with_name(path.name + ".tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise OSError(exc.errno, f"writing {path} failed: {exc.strerror or exc}") from None
    tmp.replace(path)


# ---- save ----------------------------------------------------------------------------------------
def save(engine: Engine, root: str | Path) -> Path:
    """Write this step's checkpoint under `root` (collective over every rank); returns its directory."""
    root = Path(root)
    g = engine.groups
    rank = g.world.rank
    name = f"step_{engine.global_step:08d}"
    final, partial = root / name, root / (name + PARTIAL)
    error = ""
    if rank == 0:
        error = _writing(lambda: _prepare(root, partial), f"creating {partial}")
    _agree(engine, error, f"saving checkpoint step {engine.global_step}")  # (also the barrier before writing)
    error = _writing(lambda: _write_json(partial / f"rank_{rank:05d}.json", _write_shard(engine, partial, rank)))
    faults.crash_point("save.shard_written", step=engine.global_step, rank=rank)
    # Every rank's shard is written, or every rank raises the first failure: a full disk on one rank
    # is one error on all, at once, instead of the others waiting out the comm timeout in a barrier.
    _agree(engine, error, f"saving checkpoint step {engine.global_step}")
    if rank == 0:
        error = _writing(lambda: _publish(engine, root, partial, final, name))
    _agree(engine, error, f"saving checkpoint step {engine.global_step}")
    return final


def _prepare(root: Path, partial: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(partial, ignore_errors=True)  # left by a save that crashed
    partial.mkdir()


def _publish(engine: Engine, root: Path, partial: Path, final: Path, name: str) -> None:
    """Rank 0: the manifest, then the atomic rename of the directory, then the oldest ones go."""
    _write_json(partial / MANIFEST, _manifest(engine, partial))
    for p in partial.glob("rank_*.json"):
        p.unlink()
    fsync_dir(partial)
    faults.crash_point("save.before_rename", step=engine.global_step, rank=0)
    if final.exists():  # saved this step before (e.g. the last step is also a periodic one)
        old = root / (name + ".old")
        final.replace(old)
        partial.replace(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        partial.replace(final)
    fsync_dir(root)
    for stale in complete_checkpoints(root)[: -engine.config.checkpoint.keep]:
        shutil.rmtree(stale, ignore_errors=True)


def _writing(work: Callable[[], None], what: str = "") -> str:
    """Run a step of the save; an OSError (full disk, quota, permissions) becomes its one-line text,
    which names the file (the writers put it in the message)."""
    try:
        work()
    except OSError as exc:
        detail = exc.strerror or str(exc)
        if exc.filename and str(exc.filename) not in detail:
            detail = f"{exc.filename}: {detail}"
        return f"{what}: {detail}" if what else detail
    return ""


def _write_shard(engine: Engine, directory: Path, rank: int) -> dict[str, object]:
    view = state_view(engine)
    entries: list[Entry] = []
    pieces: list[dict[str, object]] = []
    for lp in view.params:
        a, b = lp.own
        if a == b:
            continue
        sliced = lp.tp_dim is not None
        for field in FIELDS:
            key = f"{field}/{lp.name}"
            entries.append(Entry(key, (b - a,), view.dtype(field), lambda lp=lp, f=field: view.read(lp, f)))
            pieces.append({"name": lp.name, "field": field, "key": key, "dtype": DTYPE_CODES[view.dtype(field)],
                           "tp_rank": lp.tp_rank if sliced else 0, "tp_size": lp.tp_size if sliced else 1,
                           "local_shape": list(lp.local_shape), "start": a, "length": b - a})
    rng = [("rng.torch", torch.get_rng_state())]
    if engine.device.type == "cuda":  # the stand-in draws from the CPU generator: rng.torch is its state
        rng.append(("rng.cuda", torch.cuda.get_rng_state(engine.device)))
    rng += [(k, gen.get_state()) for k, gen in rng_generators(engine)]
    for key, state in rng:
        entries.append(Entry(key, tuple(state.shape), torch.uint8, lambda s=state: s))
    local = view.local_keys()  # this rank's own optimizer state (1-bit Adam's residuals)
    for key, numel in local.items():
        entries.append(Entry(key, (numel,), torch.float32, lambda key=key: view.read_local(key)))
    file = f"rank_{rank:05d}.safetensors"
    where, sha, size = write_safetensors(directory / file, entries, {"format": FORMAT, "rank": str(rank)})
    for piece in pieces:
        offset, nbytes, crc = where[piece["key"]]  # type: ignore[index]
        piece.update(file=file, offset=offset, nbytes=nbytes, crc32=crc)
    g = engine.groups
    return {"rank": rank, "coord": {"dp": g.dp.rank, "pp": g.pp.rank, "tp": g.tp.rank, "cp": g.cp.rank}, "file": file,
            "sha256": sha, "bytes": size, "pieces": pieces,
            "params": {lp.name: lp.describe() for lp in view.params},
            "rng": {k: list(where[k]) for k, _ in rng}, "local": {k: list(where[k]) for k in local},
            "optimizer_step": view.optimizer_step}


def _manifest(engine: Engine, directory: Path) -> dict[str, object]:
    ranks = [json.loads((directory / f"rank_{r:05d}.json").read_text()) for r in range(engine.groups.world.size)]
    params: dict[str, object] = {}
    for idx in ranks:
        for name, desc in idx["params"].items():
            if params.setdefault(name, desc) != desc:
                raise CheckpointError(f"ranks disagree on parameter {name}: {params[name]} vs {desc}")
    cfg = engine.config
    derived = cfg.derived(engine.groups.world.size)
    return {
        "format": FORMAT, "version": VERSION, "step": engine.global_step,
        "layout": _layout(engine), "config": cfg.as_dict(),
        # A transformers model: what `capstan checkpoint export --format hf` writes its config.json from.
        "hf": {**engine.hf_source, "pipelined": engine.pipeline is not None} if engine.hf_source else None,
        "train_state": {
            "global_step": engine.global_step,
            "consumed_samples": engine.global_step * derived["global_batch"],
            "optimizer_step": ranks[0]["optimizer_step"],
            "scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        },
        "params": params,
        "numel": sum(_numel(d["shape"]) for d in params.values()),  # type: ignore[index]
        "files": {idx["file"]: {"rank": idx["rank"], "coord": idx["coord"], "sha256": idx["sha256"],
                                "bytes": idx["bytes"], "rng": idx["rng"], "local": idx["local"]} for idx in ranks},
        "pieces": [p for idx in ranks for p in idx["pieces"]],
    }


def _numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


# ---- find ----------------------------------------------------------------------------------------
def complete_checkpoints(root: Path) -> list[Path]:
    """Complete checkpoints under `root`, oldest first (a manifest and no .partial suffix)."""
    found = [p for p in root.glob("step_*") if p.is_dir() and p.suffix == "" and (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: p.name)


def incomplete_checkpoints(root: Path) -> list[Path]:
    """Directories under `root` that look like checkpoints but cannot be loaded, oldest first: a save
    that did not finish (``.partial``) or a ``step_*`` directory without its manifest."""
    if not root.is_dir():
        return []
    found = [p for p in root.glob("step_*") if p.is_dir() and p.suffix in ("", PARTIAL) and not (p / MANIFEST).exists()]
    return sorted(found, key=lambda p: p.name)


def latest(path: str | Path) -> Path | None:
    """`path` itself if it is a checkpoint, else the newest complete one under it (None if none)."""
    path = Path(path)
    if (path / MANIFEST).exists():
        return path
    done = complete_checkpoints(path) if path.is_dir() else []
    return done[-1] if done else None


def read_manifest(directory: Path) -> dict:
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {directory / MANIFEST}: {exc}") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(f"{directory / MANIFEST} is not a {FORMAT} version {VERSION} manifest")
    for file, meta in manifest["files"].items():
        path = directory / file
        if not path.exists():
            raise CheckpointError(f"checkpoint shard {path} is missing")
        if path.stat().st_size != meta["bytes"]:
            raise CheckpointError(f"checkpoint shard {path} is truncated or altered: {path.stat().st_size} "
                                  f"bytes, the manifest says {meta['bytes']}")
    return manifest


def piece_index(manifest: dict) -> dict[tuple[str, str], list[dict]]:
    index: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for piece in manifest["pieces"]:
        index[(piece["name"], piece["field"])].append(piece)
    return index


def assemble(directory: Path, manifest: dict, pieces: list[dict], name: str) -> torch.Tensor:
    """The full logical fp32 tensor `name` from its pieces (every element covered exactly once; bf16 pieces,
    Adam's moments under precision.optimizer_states = "bf16", widened exactly)."""
    desc = manifest["params"][name]
    by_rank: dict[int, list[dict]] = defaultdict(list)
    for p in pieces:
        by_rank[p["tp_rank"]].append(p)
    tp_size = pieces[0]["tp_size"]
    if sorted(by_rank) != list(range(tp_size)):
        raise CheckpointError(f"{directory}: {name} lacks tensor-parallel slices (has {sorted(by_rank)} of {tp_size})")
    slices = []
    for r in range(tp_size):
        parts = sorted(by_rank[r], key=lambda p: p["start"])
        shape = parts[0]["local_shape"]
        flat = torch.empty(_numel(shape))
        pos = 0
        for p in parts:
            if p["start"] != pos:
                raise CheckpointError(f"{directory}: {p['field']} of {name} (tp rank {r}) has a gap or overlap "
                                      f"at element {pos}")
            path = directory / p["file"]
            try:
                flat[pos : pos + p["length"]] = read_tensor(path, p["offset"], p["nbytes"], p.get("dtype", "F32"),
                                                            p["crc32"])
            except (OSError, EOFError, ValueError) as exc:
                raise CheckpointError(str(exc)) from None
            pos += p["length"]
        if pos != flat.numel():
            raise CheckpointError(f"{directory}: {name} (tp rank {r}) covers {pos} of {flat.numel()} elements")
        slices.append(flat.view(shape))
    return merge_tp(slices, desc["tp_dim"], desc["tp_fused"], tuple(desc["shape"]))


# ---- load ----------------------------------------------------------------------------------------
def load(engine: Engine, path: str | Path) -> int:
    """Load the checkpoint at `path` (a step directory or a root holding them) into `engine`.

    Collective: every rank raises the same CheckpointError if any rank fails. Returns the step.
    """
    error = ""
    step = 0
    try:
        step = _load(engine, Path(path))
    except CheckpointError as exc:
        error = str(exc)
    _agree(engine, error)
    return step


def load_latest(engine: Engine, root: str | Path) -> int:
    """Resume: load the newest complete checkpoint under `root`; 0 (and nothing loaded) if there is none."""
    if latest(root) is None:
        return 0
    return load(engine, root)


def _agree(engine: Engine, error: str, context: str = "") -> None:
    """Raise the first failing rank's error on every rank (a collective: every rank calls it)."""
    first = comm.first_error(error, engine.groups.world)
    if first:
        raise CheckpointError(f"{context}: {first}" if context else first)


def _load(engine: Engine, path: Path) -> int:
    directory = latest(path)
    if directory is None:
        partial = sorted(path.glob(f"step_*{PARTIAL}")) if path.is_dir() else []
        hint = f" (only incomplete {partial[-1].name})" if partial else ""
        if path.name.endswith(PARTIAL):
            hint = " (it is a save that did not finish)"
        raise CheckpointError(f"no complete checkpoint at {path}{hint}")
    manifest = read_manifest(directory)
    index = piece_index(manifest)
    view = state_view(engine)
    for lp in view.params:
        source = lp.name if lp.name in manifest["params"] or lp.alias is None else lp.alias
        desc = manifest["params"].get(source)
        if desc is None:
            raise CheckpointError(f"checkpoint {directory} has no parameter {lp.name} "
                                  f"(it has {len(manifest['params'])} parameters)")
        if tuple(desc["shape"]) != lp.full_shape:
            raise CheckpointError(f"checkpoint {directory}: {lp.name} has shape {tuple(desc['shape'])}, "
                                  f"this model's is {lp.full_shape}")
        _load_param(directory, manifest, index, view, lp, source)
    state = manifest["train_state"]
    view.optimizer_step = int(state["optimizer_step"])
    view.finish_load()
    if engine.scaler is not None and state["scaler"] is not None:
        engine.scaler.load_state_dict(state["scaler"])
    if _same_layout(manifest["layout"], engine):
        _load_rng(engine, directory, manifest)
        _load_local(view, directory, manifest, engine.groups.world.rank)
    elif view.local_keys():
        comm.log_rank0(log, "checkpoint %s was saved under another layout: 1-bit Adam's error-feedback residuals "
                       "start from zero", directory)
    engine.global_step = int(state["global_step"])
    return engine.global_step


def _load_param(directory: Path, manifest: dict, index: dict, view: object, lp: LocalParam, source: str) -> None:
    for field in FIELDS:
        pieces = index.get((source, field))
        if not pieces:
            raise CheckpointError(f"checkpoint {directory} has no {field} for {lp.name}")
        full = assemble(directory, manifest, pieces, source)
        view.write(lp, field, slice_tp(full, lp))  # type: ignore[attr-defined]


def _load_local(view: object, directory: Path, manifest: dict, rank: int) -> None:
    """Same layout: this rank's own optimizer state (`StateView.local_keys`), where the checkpoint has it
    (one saved without compression has none: the state stays as it starts, zero)."""
    file = f"rank_{rank:05d}.safetensors"
    stored = manifest["files"].get(file, {}).get("local", {})
    for key, numel in view.local_keys().items():  # type: ignore[attr-defined]
        if key not in stored:
            continue
        offset, nbytes, crc = stored[key]
        try:
            data = read_tensor(directory / file, offset, nbytes, "F32", crc)
        except (OSError, EOFError, ValueError) as exc:
            raise CheckpointError(str(exc)) from None
        if data.numel() != numel:
            raise CheckpointError(f"checkpoint {directory}: {key} of rank {rank} has {data.numel()} elements, "
                                  f"this run's has {numel}")
        view.write_local(key, data)  # type: ignore[attr-defined]


def _load_rng(engine: Engine, directory: Path, manifest: dict) -> None:
    """Same layout: this rank's own RNG states (dropout streams continue exactly)."""
    file = f"rank_{engine.groups.world.rank:05d}.safetensors"
    meta = manifest["files"].get(file)
    if meta is None:
        return
    stored = meta["rng"]

    def get(key: str) -> torch.Tensor:
        offset, nbytes, crc = stored[key]
        try:
            return read_tensor(directory / file, offset, nbytes, "U8", crc)
        except (OSError, EOFError, ValueError) as exc:
            raise CheckpointError(str(exc)) from None

    torch.set_rng_state(get("rng.torch"))
    if "rng.cuda" in stored:
        torch.cuda.set_rng_state(get("rng.cuda"), engine.device)
    for key, gen in rng_generators(engine):
        if key in stored:
            gen.set_state(get(key))
