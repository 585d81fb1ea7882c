"""DeepSpeed configs translated into capstan's (config/deepspeed.py), shaped like DeepSpeed's own examples
(written here, nothing downloaded): every key with an equivalent becomes it, every other is named, and
the translated runs train (`capstan train --deepspeed`, and `initialize(deepspeed=...)`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from capstan.engine import ConfigError, cli, initialize, open_data, train_batches
from capstan.engine.config import from_deepspeed, resolve

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
                "zero_optimization.offload_param.buffer_count", "offload to nvme: set memory.cpu_budget"):
        assert any(n.startswith(key) for n in notes), (key, notes)
    sections, notes = from_deepspeed(STATIC_FP16, world_size=1)
    assert any("fp16.loss_scale = 128" in n for n in notes) and any("optimizer.type = 'Lamb'" in n for n in notes)
    assert any(n.startswith("optimizer.params.max_coeff") for n in notes)


def test_batch_sizes_must_agree_as_deepspeed_checks() -> None:
    with pytest.raises(ConfigError, match=r"train_batch_size = 16 is not .* \(3\) x .* \(2\) x data-parallel ranks \(2,"):
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
    with pytest.raises(ConfigError, match="offload = \"disk\" needs memory.cpu_budget"):
        resolve(TINY, layers=[(from_deepspeed(ds)[0], "ds")])
