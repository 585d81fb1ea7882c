"""Hugging Face `transformers` models train through `initialize(model=...)` as they are: no wrapper.

A GPT-2, a Llama (grouped-query attention) and a BERT masked LM built from tiny configs with random
weights (nothing downloaded) return `ModelOutput`s; the engine takes their logits, and trains them
with the same losses as a plain PyTorch loop (torch AdamW with decay on matrices only,
clip_grad_norm_, constant learning rate) within 1e-5 relative over 10 steps in fp32: one process,
cpu offload (a budget written with a unit and checked against this model, not the reference GPT),
dp = 2 with ZeRO-3 through disk, tp = 2 with the shipped plans, pp = 2 and tp 2 x pp 2 with the
shipped split; export --format hf loads back with identical logits. A batch that is a dict with labels
uses the loss the model returns.
"""

from __future__ import annotations

import json
import tempfile

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the transformers package is not installed")

from capstan.comm.testing import run_ranks  # noqa: E402
from capstan.engine import initialize, open_data, train_batches  # noqa: E402
from capstan.engine.testing import assert_trajectories_close  # noqa: E402

STEPS = 10


def hf_model(family: str) -> torch.nn.Module:
    torch.manual_seed(7)
    if family == "bert":
        cfg = transformers.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                                      attention_probs_dropout_prob=0.0, pad_token_id=0)
        return transformers.BertForMaskedLM(cfg)
    if family == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                      bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                      attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(cfg)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return transformers.LlamaForCausalLM(cfg)


def _config(**sections: dict) -> dict:
    base = {"model": {"seq_len": 16}, "data": {"max_bytes": 100_000},
            "train": {"steps": STEPS, "micro_batch_size": 4, "lr": 3e-3, "lr_schedule": "constant",
                      "warmup_steps": 0, "grad_clip": 1.0, "weight_decay": 0.1}}
    for name, body in sections.items():
        base[name] = {**base.get(name, {}), **body}
    return base


def plain_losses(family: str) -> list[float]:
    """A plain PyTorch loop over the same batches."""
    from capstan.engine.config import resolve

    cfg, _ = resolve(_config(), reference_model=False)
    model = hf_model(family)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                            lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    it = train_batches(open_data(cfg), cfg, 1, 0)
    out = []
    for _ in range(STEPS):
        x, y = next(it)
        logits = model(x).logits
        loss = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        out.append(loss.item())
    return out


def capstan_losses(family: str, **sections: dict) -> list[float]:
    engine = initialize(model=hf_model(family), config=_config(**sections))
    it = train_batches(open_data(engine.config), engine.config, engine.groups.dp.size, engine.groups.dp.rank)
    losses = [engine.train_batch(it).loss for _ in range(STEPS)]
    engine.close()
    return losses


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_hf_model_trains_as_a_plain_loop(family: str) -> None:
    want = plain_losses(family)
    assert want[-1] < want[0]
    assert_trajectories_close(capstan_losses(family), want)
    # offload "cpu" with a budget in units, checked against this model's states (the reference GPT of
    # [model] would be far smaller): enough for its 16 bytes per parameter passes...
    assert_trajectories_close(capstan_losses(family, memory={"offload": "cpu", "cpu_budget": "8MiB"}), want)
    # ...and too little is refused naming this model's states
    from capstan.engine import ConfigError

    params = sum(p.numel() for p in hf_model(family).parameters())
    with pytest.raises(ConfigError, match=f"below the model states' {16 * params} bytes"):
        capstan_losses(family, memory={"offload": "cpu", "cpu_budget": "64KiB"})


def _two_ranks(families: list[str]) -> dict[str, list[float]]:
    torch.set_num_threads(1)
    half = {"micro_batch_size": 2}  # the same global batch of 4 sequences as the plain loop
    out = {"llama zero2": capstan_losses("llama", train=half, parallel={"zero_stage": 2})}
    for family in families:
        with tempfile.TemporaryDirectory() as tmp:
            out[family] = capstan_losses(family, train=half, parallel={"zero_stage": 3},
                                         memory={"offload": "disk", "cpu_budget": "2MiB", "disk_dir": tmp})
    return out


def test_hf_models_at_dp2_zero3_through_disk_and_zero2() -> None:
    families = ["gpt2", "llama", "bert"]
    wants = {f: plain_losses(f) for f in families}
    for result in run_ranks(_two_ranks, 2, families, timeout=300):
        assert_trajectories_close(result.pop("llama zero2"), wants["llama"])
        for family, got in result.items():
            assert_trajectories_close(got, wants[family]), family


def _tp2(families: list[str]) -> dict[str, list[float]]:
    """tp = 2 with the shipped plan of each family (capstan.tensorpar.hf_plan), picked by the model's config."""
    torch.set_num_threads(1)
    out = {}
    for family in families:
        out[family] = capstan_losses(family, parallel={"tp": 2})
        # (dp = 1: the whole batch on each tp rank, as the plain loop)
    engine = initialize(model=hf_model("gpt2"), config=_config(parallel={"tp": 2}))
    out["sliced"] = sorted({type(m).__name__ for m in engine.module.modules() if "Parallel" in type(m).__name__})
    engine.close()
    return out


def test_shipped_tensor_parallel_plans_for_gpt2_llama_and_bert() -> None:
    families = ["gpt2", "llama", "bert"]
    wants = {f: plain_losses(f) for f in families}
    for result in run_ranks(_tp2, 2, families, timeout=300):
        for family in families:
            assert_trajectories_close(result[family], wants[family]), family
        assert result["sliced"] == ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding"]


def test_a_model_without_a_plan_is_refused_at_tp2() -> None:
    from capstan.comm import Topology
    from capstan.comm.job.groups import Group, Groups

    one = Group("x", (0,), 0)
    groups = Groups(world=Group("world", (0, 1), 0), dp=one, pp=one, tp=Group("tp", (0, 1), 0), topology=Topology(tp=2))
    from capstan.engine.model.models import slice_for_tp

    with pytest.raises(ValueError, match="capstan ships tensor-parallel plans for transformers models of the families "
                                         "bert, gpt2, llama, mistral, qwen2"):
        slice_for_tp(torch.nn.Linear(4, 4), groups)
    bad = transformers.LlamaConfig(vocab_size=256, hidden_size=48, intermediate_size=64, num_hidden_layers=1,
                                   num_attention_heads=6, num_key_value_heads=3)
    from capstan.tensorpar import hf_plan

    with pytest.raises(ValueError, match="config.num_key_value_heads = 3 is not divisible by parallel.tp = 2"):
        hf_plan(transformers.LlamaForCausalLM(bad), 2)


def test_a_dict_batch_uses_the_models_own_loss() -> None:
    engine = initialize(model=hf_model("gpt2"), config=_config(train={"steps": 2}))
    x = torch.randint(0, 256, (4, 16), generator=torch.Generator().manual_seed(0))
    loss = engine({"input_ids": x, "labels": x})  # the model shifts the labels itself
    with torch.no_grad():
        want = hf_model("gpt2")(input_ids=x, labels=x).loss
    assert float(loss.detach()) == pytest.approx(float(want), rel=1e-6)
    engine.backward(loss)
    assert engine.step() is not None
    engine.close()


def _pipelines(families: list[str]) -> dict[str, list[float]]:
    """pp = 2 (and tp 2 x pp 2 on four ranks) with the shipped split: embedding / decoder layers / norm + head."""
    torch.set_num_threads(1)
    from capstan import comm

    tp = 2 if comm.world().size == 4 else 1
    pipe = {"micro_batch_size": 2, "grad_accum_steps": 2}  # the plain loop's 4 sequences as 2 micro-batches
    return {f: capstan_losses(f, train=pipe, parallel={"pp": 2, "tp": tp, "dp": 1}) for f in families}


def test_shipped_pipeline_split_for_gpt2_llama_and_bert() -> None:
    families = ["gpt2", "llama", "bert"]
    wants = {f: plain_losses(f) for f in families}
    for ranks in (2, 4):  # pp 2, then tp 2 x pp 2
        for result in run_ranks(_pipelines, ranks, families, timeout=300):
            for family, got in result.items():
                assert_trajectories_close(got, wants[family]), (ranks, family)


def test_a_transformers_model_built_on_meta_goes_straight_into_chunks(tmp_path) -> None:
    """`with torch.device("meta"): LlamaForCausalLM(config)`: no values exist until chunked memory
    materializes each module into its chunks with the model's own `_init_weights`; it then trains."""
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   initializer_range=0.02)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(cfg)
    seen = []
    real = model._init_weights
    model._init_weights = lambda m: (seen.append(type(m).__name__), real(m))  # type: ignore[method-assign]
    engine = initialize(model=model, config=_config(memory={"offload": "disk", "cpu_budget": "1MiB",
                                                            "chunk_size": 16384, "disk_dir": str(tmp_path)}))
    assert "Linear" in seen and "LlamaRMSNorm" in seen and "Embedding" in seen
    weights = engine.parameters_snapshot()
    std = weights["model.layers.0.mlp.up_proj.weight"].std().item()
    assert abs(std - 0.02) < 0.003  # the model's initializer_range, not PyTorch's default init
    assert torch.equal(weights["model.norm.weight"], torch.ones(64))
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    losses = [engine.train_batch(it).loss for _ in range(STEPS)]
    assert losses[-1] < losses[0] and engine.memory_stats()["mem.moved_bytes"] > 0  # streamed through disk
    engine.close()


def _save_pp2(family: str, ckpt: str) -> None:
    torch.set_num_threads(1)
    engine = initialize(model=hf_model(family), config=_config(train={"micro_batch_size": 2, "grad_accum_steps": 2},
                                                              parallel={"pp": 2, "dp": 1}))
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    for _ in range(3):
        engine.train_batch(it)
    engine.save(ckpt)
    engine.close()


@pytest.mark.parametrize("family", ["gpt2", "llama", "bert"])
def test_export_hf_loads_in_transformers_with_the_same_logits(tmp_path, family: str) -> None:
    """A checkpoint saved at pp = 2 (the split model's names) exports to a directory transformers'
    from_pretrained loads, whose logits equal those of the checkpoint's values put into the model."""
    from capstan.engine.checkpoint.tools import export

    ckpt = tmp_path / "ckpt"
    run_ranks(_save_pp2, 2, family, str(ckpt), timeout=300)
    out = export(ckpt, tmp_path / "hf", "hf")
    auto = transformers.AutoModelForMaskedLM if family == "bert" else transformers.AutoModelForCausalLM
    loaded = auto.from_pretrained(out)
    # the reference: the same checkpoint loaded by capstan into the one-process model
    engine = initialize(model=hf_model(family), config=_config())
    engine.load(ckpt)
    values = engine.parameters_snapshot()
    engine.close()
    want = hf_model(family)
    want.load_state_dict(values, strict=False)
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(loaded(x).logits, want(x).logits)
    assert not torch.equal(want(x).logits, hf_model(family)(x).logits)  # it did train
    with pytest.raises(Exception, match="not of a transformers model"):
        engine2 = initialize(config=_config())
        engine2.save(tmp_path / "gpt")
        engine2.close()
        export(tmp_path / "gpt", tmp_path / "nope", "hf")


def _load_at_pp2(ckpt: str) -> list[float]:
    torch.set_num_threads(1)
    engine = initialize(model=hf_model("gpt2"), config=_config(train={"micro_batch_size": 2, "grad_accum_steps": 2},
                                                              parallel={"pp": 2, "dp": 1}))
    step = engine.load(ckpt)
    it = train_batches(open_data(engine.config), engine.config, 1, 0, start_step=step)
    losses = [engine.train_batch(it).loss for _ in range(step, STEPS)]
    engine.close()
    return losses


def test_a_one_process_checkpoint_of_a_tied_model_resumes_pipelined(tmp_path) -> None:
    """GPT-2 ties lm_head to wte: one process lists it once, so the head's stage takes the embedding's."""
    engine = initialize(model=hf_model("gpt2"), config=_config())
    it = train_batches(open_data(engine.config), engine.config, 1, 0)
    for _ in range(4):
        engine.train_batch(it)
    engine.save(tmp_path / "ck")
    engine.close()
    want = plain_losses("gpt2")
    for got in run_ranks(_load_at_pp2, 2, str(tmp_path / "ck"), timeout=300):
        assert_trajectories_close(got, want[4:])


def test_capstan_train_with_model_hf_and_export_round_trip(tmp_path) -> None:
    """[model] hf = a transformers config: `capstan train` builds it (into chunks, on meta), trains it,
    exports --format hf; model.hf = that export then fine-tunes from its weights."""
    from capstan.engine import cli

    hf_model("llama").config.save_pretrained(tmp_path / "cfg")
    run = tmp_path / "run"
    base = ["train", "--config", str(tmp_path / "c.json"), "--set", f'log.run_dir="{run}"']
    (tmp_path / "c.json").write_text(json.dumps({**_config(memory={"offload": "cpu"}), "checkpoint": {"every": 5},
                                                 "model": {"seq_len": 16, "hf": str(tmp_path / "cfg")}}))
    assert cli.main(base) == 0
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == STEPS and records[-1]["loss"] < records[0]["loss"]
    assert cli.main(["checkpoint", "export", str(run / "checkpoints"), str(tmp_path / "out"), "--format", "hf"]) == 0
    tuned = tmp_path / "run2"
    assert cli.main(base[:3] + ["--set", f'log.run_dir="{tuned}"', "--set", f'model.hf="{tmp_path / "out"}"',
                                "--set", "train.steps=1"]) == 0
    first = json.loads((tuned / "metrics.jsonl").read_text().splitlines()[0])
    assert first["loss"] < records[0]["loss"] - 0.5  # it started from the trained weights
