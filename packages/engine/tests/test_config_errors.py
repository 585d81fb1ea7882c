"""Bad input -> exactly one line on stderr and exit code 2, before anything heavy starts.

Most cases run in-process through `cli.main(argv)`; a few through a real
`capstan` subprocess (the multi-rank case is in integration_tests).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from capstan.comm.testing import clean_env
from capstan.engine import cli
from capstan.engine.config.doc import render
from capstan.engine.config.load import ConfigError, parse_override, resolve, to_toml

GOOD = """
[model]
n_layers = 1
n_heads = 4
d_model = 32
seq_len = 16
[data]
max_bytes = 100000
[train]
steps = 2
micro_batch_size = 2
warmup_steps = 1
"""


def _write(tmp: Path, name: str, text: str | bytes) -> str:
    p = tmp / name
    p.write_bytes(text if isinstance(text, bytes) else text.encode())
    return str(p)


def _cases(tmp: Path) -> list[tuple[list[str], str]]:
    good = _write(tmp, "good.toml", GOOD)
    odd_bin = _write(tmp, "odd.bin", b"\x01\x02\x03")
    big_id = _write(tmp, "bigid.bin", np.array([1, 2, 300] * 100, dtype=np.uint16).tobytes())
    short = _write(tmp, "short.txt", "tiny text")
    bad_json = _write(tmp, "bad.json", json.dumps({"train": {"stepz": 3}}))
    bad_toml = _write(tmp, "bad.toml", "[train\nsteps = 3")
    not_table = _write(tmp, "nt.toml", "train = 5")
    bad_tok = _write(tmp, "bad-tokenizer.json", "{not json")
    s = ["train", "--config", good, "--set"]
    return [
        (s + ["train.lrr=0.1"], "did you mean 'train.lr'"),
        (s + ["trian.steps=3"], "did you mean 'train'"),
        (s + ["train.steps=\"ten\""], "train.steps must be int"),
        (s + ["train.steps=true"], "train.steps must be int"),
        (s + ["model.n_layers=2.5"], "model.n_layers must be int"),
        (s + ["train.lr=-1.0"], "train.lr = -1.0 must be > 0.0"),
        (s + ["train.lr=nan"], "train.lr must be a finite number"),
        (s + ["model.dropout=1.0"], "model.dropout = 1.0 must be < 1.0"),
        (s + ["train.lr_schedule=\"cosin\""], "did you mean 'cosine'"),
        (s + ["memory.offload=\"nvme\""], "memory.offload = 'nvme' is not one of"),
        (s + ["precision.dtype=\"fp8\""], "precision.dtype = 'fp8' is not one of"),
        (s + ["model.d_model=30"], "model.d_model = 30 must be divisible by model.n_heads = 4"),
        (s + ["parallel.tp=3"], "parallel.tp = 3 must divide model.n_heads = 4"),
        (s + ["parallel.dp=2"],
         "(dp from --set parallel.dp=2, tp from default, pp from default) but world size 1 from default"),
        (s + ["parallel.pp=2"], "world size 1 from default is not divisible by parallel.tp * parallel.pp = 1 * 2"),
        (s + ["parallel.pp=2", "--set", "parallel.schedule=\"interleaved\""], "needs parallel.virtual_stages >= 2"),
        (s + ["parallel.pp=8"], "8 pipeline parts, but the model has only 4 layers"),
        (s + ["parallel.virtual_stages=2"], "needs parallel.schedule = \"interleaved\""),
        (s + ["train.min_lr=1.0"], "train.min_lr = 1.0 must not exceed train.lr"),
        (s + ["train.warmup_steps=9"], "train.warmup_steps = 9 exceeds train.steps = 2"),
        (s + ["model.vocab_size=100"], "smaller than the byte tokenizer's 256 ids"),
        (s + ["data.tokenizer=\"bpe\""], "model.vocab_size = 256 leaves data.tokenizer = \"bpe\" no merges"),
        (s + ["data.tokenizer=\"bpe\"", "--set", f"data.tokenizer_file={tmp / 'no-tok.json'}"],
         "no-tok.json' does not exist"),
        (s + ["data.tokenizer=\"bpe\"", "--set", f"data.tokenizer_file={bad_tok}"], "cannot load the tokenizer"),
        (s + [f"data.tokenizer_file={bad_tok}"], "it only applies to data.tokenizer = \"bpe\""),
        (s + ["memory.cpu_budget=1000000"], "memory.cpu_budget only applies to chunked memory"),
        (s + ["memory.offload=\"disk\"", "--set", "memory.cpu_budget=1000"], "cannot hold one chunk"),
        # Past the config check (one 1024-element chunk fits), below the chunk sized for the model.
        (s + ["memory.offload=\"disk\"", "--set", "memory.cpu_budget=5000", "--set", f"memory.disk_dir={tmp / 'c'}"],
         "the size chosen for this model)"),
        (s + ["memory.offload=\"cpu\"", "--set", "memory.cpu_budget=4194304", "--set", "model.d_model=256"],
         "below the model states'"),
        # States past the machine's RAM or disk (a 257B-parameter GPT, never materialized): refused at start
        (s + ["model.n_layers=20", "--set", "model.d_model=32768", "--set", "memory.offload=\"disk\"", "--set",
              "memory.cpu_budget=1000000000", "--set", f"memory.disk_dir={tmp / 'huge'}"],
         "the model states of the 1 rank(s) on this node do not fit its disk: they need at least"),
        (s + ["model.n_layers=20", "--set", "model.d_model=32768", "--set", "memory.offload=\"cpu\""],
         "the model states of the 1 rank(s) on this node do not fit its RAM: they need at least"),
        (s + ["parallel.zero_stage=4"], "parallel.zero_stage = 4 must be <= 3"),
        (s + ["parallel.compression=\"onebit\"", "--set", "parallel.zero_stage=1"],
         "parallel.compression = \"onebit\" needs parallel.zero_stage = 0"),
        (s + ["parallel.compression=\"int8\""], "parallel.compression = \"int8\" needs parallel.zero_stage 1-3"),
        (s + ["parallel.compression=\"onebit\"", "--set", "parallel.zero_stage=3"],
         "1-bit Adam all-reduces the whole momentum on every dp rank, which ZeRO 1-3 shard"),
        (s + ["parallel.compression=\"2bit\""], "parallel.compression = '2bit' is not one of"),
        (s + ["parallel.compression_freeze_steps=0"], "parallel.compression_freeze_steps = 0 must be >= 1"),
        (s + [f"checkpoint.load={tmp / 'no-such-run'}"], "no complete checkpoint there"),
        (s + ["memory.ram_limit=1000000"], "memory.ram_limit = 1000000 needs chunked memory"),
        (s + ["memory.gpu_budget=1000000"], "memory.gpu_budget = 1000000 needs chunked memory"),
        (s + ["memory.gpu_budget=1000000", "--set", "memory.offload=\"cpu\"", "--set", "train.device=\"cpu\""],
         "on a GPU (train.device = \"cuda\" or \"auto\")"),
        (s + ["train.device=\"gpu\""], "train.device = 'gpu' is not one of"),
        (s + ["data.max_bytes=10"], "data.max_bytes = 10 must be >= 1024"),
        (s + ["train.steps"], "expected section.key=value"),
        (s + ["steps=3"], "the key must be section.key"),
        (s + [f"data.source={tmp / 'nope.txt'}"], "does not exist"),
        (s + [f"data.source={odd_bin}"], "not a multiple of 2 (uint16)"),
        (s + [f"data.source={big_id}"], "holds token id 300"),
        (s + [f"data.source={short}"], "training tokens; model.seq_len = 16 needs at least 18"),
        *([] if torch.cuda.is_available() else [
            (s + ["train.device=\"cuda\""], "device \"cuda\" asked for, but"),
            (s + ["memory.gpu_budget=1000000", "--set", "memory.offload=\"cpu\""],
             "memory.gpu_budget = 1000000 needs a GPU, but train.device = \"auto\" found none"),
        ]),
        (["train", "--config", str(tmp / "missing.toml")], "does not exist"),
        (["train", "--config", bad_toml], "is not valid TOML"),
        (["train", "--config", bad_json], "did you mean 'train.steps'"),
        (["train", "--config", not_table], "[train] in"),
        (["train"], "give --config FILE (a capstan config) or --deepspeed FILE"),
    ]


def test_every_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    cases = _cases(tmp_path)
    assert len(cases) >= 25
    for argv, expected in cases:
        code = cli.main(argv)
        out = capsys.readouterr()
        lines = out.err.strip().splitlines()
        assert code == 2, (argv, out.err)
        assert len(lines) == 1, (argv, out.err)
        assert lines[0].startswith("capstan: error:") and expected in lines[0], (argv, lines[0])
    assert not (tmp_path / "huge").exists()  # refused before the disk tier made its directory or file


def test_bpe_without_the_tokenizers_package_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tokenizers" else real(name, *a))
    good = _write(tmp_path, "good.toml", GOOD)
    code = cli.main(["train", "--config", good, "--set", "data.tokenizer=\"bpe\"", "--set", "model.vocab_size=512"])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "pip install tokenizers" in lines[0], lines


def _capstan() -> list[str]:
    exe = shutil.which("capstan")
    return [exe] if exe else [sys.executable, "-m", "capstan.engine.cli"]


def test_bad_input_through_real_processes(tmp_path: Path) -> None:
    good = _write(tmp_path, "good.toml", GOOD)
    odd = _write(tmp_path, "odd.bin", b"\x01\x02\x03")
    for extra, expected in ((["--set", "train.lrr=1"], "did you mean 'train.lr'"),
                            (["--set", f"data.source={odd}"], "not a multiple of 2"),
                            (["--set", "parallel.dp=4"], "world size 1 from default")):
        out = subprocess.run(_capstan() + ["train", "--config", good] + extra, capture_output=True, text=True,
                             timeout=120, env=clean_env())
        assert out.returncode == 2, out.stderr
        lines = out.stderr.strip().splitlines()
        assert len(lines) == 1 and expected in lines[0], out.stderr
    debug = subprocess.run(_capstan() + ["train", "--config", good, "--set", "train.lrr=1", "--debug"],
                           capture_output=True, text=True, timeout=120, env=clean_env())
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "ConfigError" in debug.stderr


def test_overrides_parse_toml_literals_and_bare_strings() -> None:
    assert parse_override("train.lr=3e-4") == ("train", "lr", 3e-4)
    assert parse_override("data.source=/data/x.txt") == ("data", "source", "/data/x.txt")
    assert parse_override("log.tensorboard=true") == ("log", "tensorboard", True)
    cfg, sources = resolve({"train": {"steps": 7}}, ["train.lr=0.5", "parallel.tp=2"])
    assert (cfg.train.steps, cfg.train.lr, cfg.parallel.tp) == (7, 0.5, 2)
    assert sources["train.steps"] == "the config dict" and sources["train.lr"] == "--set train.lr=0.5"
    assert cfg.train.lr == 0.5 and isinstance(resolve({"train": {"lr": 1}})[0].train.lr, float)
    with pytest.raises(ConfigError, match="did you mean 'model.d_model'"):
        resolve({"model": {"dmodel": 3}})


def test_derived_values_and_resolved_toml_round_trip() -> None:
    cfg, _ = resolve({"train": {"micro_batch_size": 4, "grad_accum_steps": 3}, "model": {"seq_len": 32}})
    d = cfg.derived(world_size=2)
    assert d["dp"] == 2 and d["global_batch"] == 24 and d["tokens_per_step"] == 768
    import tomllib

    again, _ = resolve(tomllib.loads(to_toml(cfg, d)))
    assert again == cfg


def test_config_reference_doc_is_current() -> None:
    doc = Path(__file__).resolve().parents[3] / "docs" / "config.md"
    assert doc.read_text() == render(), "run: python -m capstan.engine.config.doc docs/config.md"


def test_sizes_with_units_and_defaults_fitted_to_the_run(caplog: pytest.LogCaptureFixture) -> None:
    cfg, _ = resolve({"memory": {"offload": "disk", "cpu_budget": "4GiB", "ram_limit": "4.5 GiB",
                                 "chunk_size": 4096}, "train": {"steps": 2}})
    assert cfg.memory.cpu_budget == 4 << 30 and cfg.memory.ram_limit == int(4.5 * 2**30)
    assert resolve({"memory": {"offload": "disk", "cpu_budget": "1.5GB"}})[0].memory.cpu_budget == 1_500_000_000
    assert resolve({"memory": {"offload": "disk", "cpu_budget": 65536}})[0].memory.cpu_budget == 65536
    with pytest.raises(ConfigError, match="memory.cpu_budget = '4 GB!' is not a size"):
        resolve({"memory": {"offload": "disk", "cpu_budget": "4 GB!"}})
    # The default warmup (5) is longer than a 2-step run: fitted with a notice, not refused.
    assert cfg.train.warmup_steps == 1 and "train.warmup_steps: the default 5 exceeds train.steps = 2" in caplog.text
    low, _ = resolve({"train": {"lr": 1e-5}})  # below the default min_lr (1e-4)
    assert low.train.min_lr == pytest.approx(1e-6)
    with pytest.raises(ConfigError, match="train.warmup_steps = 9 exceeds train.steps = 2"):
        resolve({"train": {"steps": 2, "warmup_steps": 9}})  # both set by the user: an error
    assert "\ncpu_budget = 4294967296\n" in to_toml(cfg)  # written back in bytes
