"""DeepSpeed configs translated into capstan's (config/deepspeed.py), shaped like DeepSpeed's own examples
(written here, nothing downloaded): every key with an equivalent becomes it, every other is named, and
the translated runs train (`capstan train --deepspeed`, and `initialize(deepspeed=...)`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from capstan import comm
from capstan.engine import ConfigError, cli, initialize, open_data, train_batches
from capstan.engine.config import from_deepspeed, resolve
from capstan.engine.machine import ram_budget
from capstan.engine.machine.ram_budget import with_default_cpu_budget

ZERO2_OFFLOAD = {  # ZeRO-Offload as in DeepSpeed's tutorial
    "train_batch_size": 16, "gradient_accumulation_steps": 2,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.8, 0.999], "eps": 1e-8, "weight_decay": 3e-7}},
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 3e-3,
                                                      "warmup_num_steps": 2, "total_num_steps": 6}},
    "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
             "hysteresis": 2, "min_loss_scale": 1},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": 2e8, "contiguous_gradients": True},
    "gradient_clipping": 1.0, "steps_per_print": 2, "wall_clock_breakdown": False,
}
ZERO3_NVME = {  # ZeRO-Infinity as in DeepSpeed's docs
    "train_micro_batch_size_per_gpu": 4,
    "bf16": {"enabled": True},
    "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_num_steps": 1, "total_num_steps": 4,
                                                       "warmup_max_lr": 1e-3, "cos_min_ratio": 0.1}},
    "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 1e9, "stage3_prefetch_bucket_size": 5e8,
                          "sub_group_size": 1e9,
                          "offload_param": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True,
                                            "buffer_count": 5},
                          "offload_optimizer": {"device": "nvme", "nvme_path": "NVME", "pin_memory": True}},
    "flops_profiler": {"enabled": False}, "some_future_key": 1,
}
STATIC_FP16 = {"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": True, "loss_scale": 128},
               "optimizer": {"type": "Lamb", "params": {"lr": 1e-3, "max_coeff": 0.3}}}


def test_zero2_offload_translates_key_by_key() -> None:
    sections, notes = from_deepspeed(ZERO2_OFFLOAD, world_size=4)
    assert sections["train"] == {"micro_batch_size": 2, "grad_accum_steps": 2, "lr": 3e-3, "beta1": 0.8,
                                 "beta2": 0.999, "eps": 1e-8, "weight_decay": 3e-7, "warmup_steps": 2,
                                 "steps": 6, "lr_schedule": "linear", "min_lr": 0.0, "grad_clip": 1.0}
    assert sections["precision"] == {"dtype": "fp16", "initial_scale": 65536.0, "window": 1000, "hysteresis": 2,
                                     "min_scale": 1.0}
    assert sections["parallel"] == {"zero_stage": 2, "bucket_mb": pytest.approx(2e8 * 4 / 2**20)}
    assert sections["memory"] == {"offload": "cpu"} and sections["log"] == {"every": 2}
    for key in ("wall_clock_breakdown", "zero_optimization.overlap_comm", "zero_optimization.contiguous_gradients",
                "zero_optimization.offload_optimizer at stage 2"):
        assert any(n.startswith(key) for n in notes), (key, notes)


def test_zero3_nvme_and_what_has_no_equivalent() -> None:
    sections, notes = from_deepspeed(ZERO3_NVME, world_size=2)
    assert sections["memory"] == {"offload": "disk", "disk_dir": "NVME"}
    assert sections["precision"] == {"dtype": "bf16"} and sections["parallel"]["zero_stage"] == 3
    assert sections["train"]["min_lr"] == pytest.approx(1e-4) and sections["train"]["lr_schedule"] == "cosine"
    for key in ("some_future_key: no equivalent", "flops_profiler: ignored", "zero_optimization.sub_group_size",
                "zero_optimization.offload_param.buffer_count", "offload to nvme: memory.cpu_budget"):
        assert any(n.startswith(key) for n in notes), (key, notes)
    sections, notes = from_deepspeed(STATIC_FP16, world_size=1)
    assert any("fp16.loss_scale = 128" in n for n in notes) and any("optimizer.type = 'Lamb'" in n for n in notes)
    assert any(n.startswith("optimizer.params.max_coeff") for n in notes)


def test_batch_sizes_must_agree_as_deepspeed_checks() -> None:
    with pytest.raises(ConfigError,
                       match=r"train_batch_size = 16 is not .* \(3\) x .* \(2\) x data-parallel ranks \(2,"):
        from_deepspeed({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3,
                        "gradient_accumulation_steps": 2}, world_size=2)
    with pytest.raises(ConfigError, match="both enabled"):
        from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    assert from_deepspeed({"train_batch_size": 8}, world_size=2)[0]["train"] == {"micro_batch_size": 4,
                                                                                 "grad_accum_steps": 1}


TINY = {"model": {"n_layers": 1, "d_model": 32, "n_heads": 4, "seq_len": 16}, "data": {"max_bytes": 100_000},
        "train": {"steps": 4}}


def test_capstan_train_with_a_deepspeed_config(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    base = tmp_path / "base.json"
    base.write_text(json.dumps(TINY))
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(ZERO2_OFFLOAD))
    run = tmp_path / "run"
    code = cli.main(["train", "--config", str(base), "--deepspeed", str(ds), "--set", f'log.run_dir="{run}"',
                     "--set", "train.micro_batch_size=8", "--set", "train.grad_accum_steps=2"])
    err = capsys.readouterr().err
    assert code == 0, err
    # (one process: train_batch_size 16 = 8 x 2 x 1; the --set values agree with it)
    assert f"capstan: deepspeed: {ds} -> train.micro_batch_size = 8" in err
    assert "capstan: deepspeed: zero_optimization.overlap_comm: ignored" in err
    resolved = (run / "config.resolved.toml").read_text()
    assert 'dtype = "fp16"' in resolved and 'offload = "cpu"' in resolved and "steps = 6" in resolved
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 6


def test_initialize_with_a_deepspeed_dict(tmp_path: Path) -> None:
    ds = json.loads(json.dumps(ZERO3_NVME).replace("NVME", str(tmp_path / "nvme")))
    engine = initialize(config=TINY, deepspeed=ds, overrides=["memory.cpu_budget=2MiB", "memory.chunk_size=8192"])
    c = engine.config
    assert (c.memory.offload, c.precision.dtype, c.parallel.zero_stage, c.train.steps) == ("disk", "bf16", 3, 4)
    it = train_batches(open_data(c), c, 1, 0)
    losses = [engine.train_batch(it).loss for _ in range(4)]
    engine.close()
    assert losses[-1] < losses[0] and (tmp_path / "nvme").is_dir()


# ---- ZeRO-Infinity without a RAM budget: memory.cpu_budget chosen from the machine (ram_budget.py) ----------


def _machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, available_kib: int | None,
             cgroup: dict[str, str] | None = None) -> None:
    """This machine as /proc/meminfo (MemAvailable) and a memory cgroup (v2) say, written under tmp_path."""
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       99999999 kB\n" + (f"MemAvailable:   {available_kib} kB\n"
                                                          if available_kib is not None else ""))
    root = tmp_path / "cgroup"
    (root / "job").mkdir(parents=True, exist_ok=True)
    for name, text in (cgroup or {}).items():
        (root / "job" / name).write_text(text)
    (tmp_path / "self-cgroup").write_text("0::/job\n")
    monkeypatch.setattr(ram_budget, "MEMINFO", str(meminfo))
    monkeypatch.setattr(ram_budget, "CGROUP_ROOT", root)
    monkeypatch.setattr(ram_budget, "PROC_CGROUP", str(tmp_path / "self-cgroup"))


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def logged() -> Iterator[list[str]]:
    handler = _Lines()
    logger = logging.getLogger("capstan.engine.machine.ram_budget")
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)


def test_zero_infinity_gets_a_cpu_budget_from_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          logged: list[str]) -> None:
    _machine(monkeypatch, tmp_path, available_kib=8 << 20)  # MemAvailable 8 GiB
    cfg, _ = resolve(TINY, layers=[(from_deepspeed(ZERO3_NVME)[0], "ds")])  # no "needs memory.cpu_budget"
    assert (cfg.memory.offload, cfg.memory.cpu_budget) == ("disk", None)
    chosen = with_default_cpu_budget(cfg, comm.single_process_groups())
    activations, minimum = ram_budget._planned(cfg, 1)  # the planner's: activations, logits, one block's gradients
    assert 0 < activations < 8 << 20 and minimum > 0
    expect = int(0.9 * ((8 << 30) - activations)) // 2**20 * 2**20
    assert chosen.memory.cpu_budget == expect and chosen.memory.disk_dir == "NVME"
    assert logged == [ram_budget.RamBudget(8 << 30, "MemAvailable", 1, activations, "the planner's estimate",
                                           minimum, "chunkmem's minimum for this model and chunk size").describe()]
    assert logged[0].startswith(f"memory.cpu_budget not set: using {expect / 2**30:.1f} GiB of chunks in RAM per "
                                "rank = 0.9 x (MemAvailable 8.0 GiB / 1 rank on this node = 8.0 GiB, minus ")
    # Ranks on a node share its RAM; a model the planner cannot see leaves a quarter of the share to activations.
    two = ram_budget.RamBudget(20 << 30, "MemAvailable", 2, int(1.5 * 2**30), "given", 1 << 20, "given")
    assert two.budget == int(0.9 * 8.5 * 2**30) // 2**20 * 2**20
    assert "MemAvailable 20.0 GiB / 2 ranks on this node = 10.0 GiB, minus 1.5 GiB for activations" in two.describe()
    user = ram_budget.derive_budget(cfg, comm.single_process_groups(), torch.device("cpu"), reference_model=False)
    assert user.activations == (8 << 30) // 4 and user.minimum == 1024 * 4  # one chunk: chunkmem checks the rest
    # A memory cgroup (a container's limit) tighter than MemAvailable: its limit less its working set.
    _machine(monkeypatch, tmp_path, available_kib=8 << 20, cgroup={
        "memory.max": str(3 << 30), "memory.current": str(1 << 30), "memory.stat": "inactive_file 536870912\n"})
    assert ram_budget.available_ram() == ((3 << 30) - (1 << 29), "the memory cgroup's limit less its working set")


def test_an_explicit_cpu_budget_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logged: list[str]) -> None:
    _machine(monkeypatch, tmp_path, available_kib=None)  # nothing to read: the key must be used as given
    cfg, _ = resolve(TINY, ["memory.cpu_budget=3MiB"], layers=[(from_deepspeed(ZERO3_NVME)[0], "ds")])
    assert with_default_cpu_budget(cfg, comm.single_process_groups()) is cfg and cfg.memory.cpu_budget == 3 << 20
    assert logged == []
    unreadable, _ = resolve(TINY, layers=[(from_deepspeed(ZERO3_NVME)[0], "ds")])
    with pytest.raises(ConfigError, match="cannot be read here: set memory.cpu_budget"):
        with_default_cpu_budget(unreadable, comm.single_process_groups())


def test_too_little_ram_for_the_chunks_is_one_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _machine(monkeypatch, tmp_path, available_kib=512)  # 512 KiB available
    cfg, _ = resolve(TINY, layers=[(from_deepspeed(ZERO3_NVME)[0], "ds")])
    activations, minimum = ram_budget._planned(cfg, 1)
    room = max(0, (1 << 19) - activations)
    message = (f"memory.cpu_budget is not set and this machine's RAM cannot hold the chunks a disk tier needs: "
               f"MemAvailable 512.0 KiB / 1 rank on this node = 512.0 KiB, minus {activations / 1024:.1f} KiB for "
               f"activations: the planner's estimate leaves {room / 1024:.1f} KiB per rank, below the "
               f"{minimum / 1024:.1f} KiB ({minimum} bytes) of chunks that must be in RAM at once, chunkmem's minimum "
               "for this model and chunk size; free RAM, run fewer ranks on this node, use a smaller "
               "memory.chunk_size, or set memory.cpu_budget")
    with pytest.raises(ConfigError) as info:
        with_default_cpu_budget(cfg, comm.single_process_groups())
    assert str(info.value) == message
    base, ds = tmp_path / "base.json", tmp_path / "ds.json"
    base.write_text(json.dumps(TINY))
    ds.write_text(json.dumps(ZERO3_NVME).replace("NVME", str(tmp_path / "nvme")))
    code = cli.main(["train", "--config", str(base), "--deepspeed", str(ds), "--set",
                     f'log.run_dir="{tmp_path / "run"}"'])
    assert code == 2  # one line, as every config error


def test_capstan_train_with_zero_infinity_and_no_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        capsys: pytest.CaptureFixture, logged: list[str]) -> None:
    base, ds, run = tmp_path / "base.json", tmp_path / "ds.json", tmp_path / "run"
    base.write_text(json.dumps(TINY))
    ds.write_text(json.dumps(ZERO3_NVME).replace("NVME", str(tmp_path / "nvme")))
    cfg, _ = resolve(TINY, layers=[(from_deepspeed(ZERO3_NVME)[0], "ds")])
    activations, minimum = ram_budget._planned(cfg, 1)
    # So little RAM that the budget is the chunks' minimum: most chunks live on disk, and it still trains.
    _machine(monkeypatch, tmp_path, available_kib=(activations + minimum) // 1024 + 64)
    code = cli.main(["train", "--config", str(base), "--deepspeed", str(ds), "--set", f'log.run_dir="{run}"',
                     "--set", "train.steps=3"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "offload to nvme: memory.cpu_budget" in err and len(logged) == 1 and "MemAvailable" in logged[0]
    assert f"cpu_budget = {minimum}" in (run / "config.resolved.toml").read_text()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 3 and records[-1]["mem.disk.peak_bytes"] > 0 and records[-1]["mem.moved_bytes"] > 0
