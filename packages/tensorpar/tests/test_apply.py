"""parallelize() on a user's own GPT-2-style model (defined here, not in capstan).

The model has a fused qkv projection, a tied embedding / LM head and a
vocabulary (51) that tp = 2 and 4 do not divide; after slicing, its outputs and
every gradient must equal the original's (1e-6 relative, norm-wise: reordered
fp32 partial sums, see test_layers.py).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from capstan import comm
from capstan.comm.testing import run_ranks

TOL = 1e-6
VOCAB, SEQ, D, HEADS, LAYERS = 51, 8, 32, 4, 2
PLAN_KEYS = {
    "*.attn.qkv": "column_qkv",
    "*.attn.proj": "row",
    "*.mlp.fc": "column",
    "*.mlp.proj": "row",
    "wte": "embedding",
    "lm_head": "column_gather",
}


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_head, self.head_dim = HEADS, D // HEADS
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        width = self.n_head * self.head_dim  # local after Divide("n_head")
        q, k, v = (t.view(b, s, self.n_head, self.head_dim).transpose(1, 2)
                   for t in self.qkv(x).split(width, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, s, width))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.proj = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(D), Attention(), nn.LayerNorm(D), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT2(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.wpe = nn.Embedding(VOCAB, D), nn.Embedding(SEQ, D)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight  # tied, as GPT-2

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def _plan():
    from capstan.tensorpar import Divide

    return {**PLAN_KEYS, "*.attn": Divide("n_head")}


def _parallelize_checks() -> dict[str, float]:
    from capstan.tensorpar import parallelize
    from capstan.tensorpar.testing import grad_errors, rel_err

    tp = comm.build_groups(comm.Topology(tp=comm.world().size)).tp
    torch.manual_seed(0)  # same dense model on every rank
    dense = TinyGPT2()
    for p in dense.parameters():  # non-zero biases and norms, so their slicing is exercised
        p.data.add_(0.01 * torch.randn(p.shape))
    sliced = parallelize(copy.deepcopy(dense), _plan(), tp)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    tgt = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(2))
    errs = {}
    outs = []
    for model in (dense, sliced):
        logits = model(ids)
        F.cross_entropy(logits.reshape(-1, VOCAB), tgt.reshape(-1)).backward()
        outs.append(logits)
    errs["logits"] = rel_err(outs[1], outs[0])
    errs.update({f"grad/{k}": v for k, v in grad_errors(sliced, dense, tp).items()})
    errs["tied"] = float(sliced.lm_head.weight is not sliced.wte.weight)
    errs["n_params"] = float(len(list(sliced.parameters())) != len(list(dense.parameters())))
    errs["local_heads"] = float(sliced.blocks[0].attn.n_head != HEADS // tp.size)
    return errs


@pytest.mark.parametrize("n", [2, 4])
def test_parallelize_user_model_matches_original(n: int) -> None:
    for rank, errs in enumerate(run_ranks(_parallelize_checks, n, timeout=180)):
        assert errs["tied"] == 0.0 and errs["n_params"] == 0.0 and errs["local_heads"] == 0.0
        assert sum(k.startswith("grad/") for k in errs) == len(list(TinyGPT2().parameters()))
        for name, err in errs.items():
            assert err <= TOL, f"tp={n} rank {rank}: {name} relative error {err:.3e}"


def test_parallelize_on_a_group_of_one_is_exact() -> None:
    from capstan.tensorpar import ColumnParallelLinear, parallelize

    torch.manual_seed(0)
    dense = TinyGPT2()
    dense.blocks[0].mlp.fc.bias.requires_grad_(False)
    sliced = parallelize(copy.deepcopy(dense), _plan(), comm.single_process_groups().tp)
    assert not sliced.blocks[0].mlp.fc.bias.requires_grad and sliced.blocks[0].mlp.fc.weight.requires_grad
    assert isinstance(sliced.blocks[1].attn.qkv, ColumnParallelLinear)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    assert torch.equal(sliced(ids), dense(ids))


def test_parallelize_errors_are_clear() -> None:
    from capstan.tensorpar import Divide, parallelize

    tp3 = comm.Group(name="tp", ranks=(0, 1, 2), rank=0)
    one = comm.single_process_groups().tp
    with pytest.raises(ValueError, match=r"'\*\.atn\.qkv' matches no module of TinyGPT2"):
        parallelize(TinyGPT2(), {"*.atn.qkv": "column"}, one)
    with pytest.raises(ValueError, match="unknown style"):
        parallelize(TinyGPT2(), {"*.attn.qkv": "colum"}, one)
    with pytest.raises(TypeError, match="needs an nn.Linear but module 'ln_f' is LayerNorm"):
        parallelize(TinyGPT2(), {"ln_f": "column"}, one)
    with pytest.raises(ValueError, match=r"blocks.0.attn.n_head \(4\) is not divisible .* \(3\)"):
        parallelize(TinyGPT2(), {"*.attn": Divide("n_head")}, tp3)
    with pytest.raises(ValueError, match=r"output features per fused block \(32\) is not divisible .* \(3\)"):
        parallelize(TinyGPT2(), {"*.attn.qkv": "column_qkv"}, tp3)
    with pytest.raises(ValueError, match="matches both"):
        parallelize(TinyGPT2(), {"*.qkv": "column", "blocks.0.*": "column"}, one)


class LlamaAttention(nn.Module):
    """Llama-style attention: separate q/k/v/o projections, no biases, rotary positions."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.head_dim = HEADS, D // HEADS
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(D, D, bias=False)

    @staticmethod
    def _rotary(t: torch.Tensor) -> torch.Tensor:  # [b, h, s, hd]: rotate pairs by position
        s, hd = t.shape[-2], t.shape[-1]
        freqs = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        ang = torch.arange(s).float()[:, None] * freqs[None, :]
        cos, sin = ang.cos(), ang.sin()
        a, b = t[..., 0::2], t[..., 1::2]
        return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (p(x).view(b, s, self.n_heads, self.head_dim).transpose(1, 2)
                   for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(self._rotary(q), self._rotary(k), v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, s, self.n_heads * self.head_dim))


class LlamaMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, 3 * D, bias=False), nn.Linear(D, 3 * D, bias=False)
        self.down_proj = nn.Linear(3 * D, D, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))  # SwiGLU


class LlamaBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(D), nn.RMSNorm(D)
        self.self_attn, self.mlp = LlamaAttention(), LlamaMLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def _llama_checks() -> dict[str, float]:
    from capstan.tensorpar import Divide, parallelize
    from capstan.tensorpar.testing import grad_errors, rel_err

    tp = comm.build_groups(comm.Topology(tp=comm.world().size)).tp
    torch.manual_seed(0)
    dense = nn.Sequential(LlamaBlock(), LlamaBlock())
    for p in dense.parameters():
        p.data.add_(0.01 * torch.randn(p.shape))
    plan = {"*.self_attn.q_proj": "column", "*.self_attn.k_proj": "column", "*.self_attn.v_proj": "column",
            "*.self_attn.o_proj": "row", "*.mlp.gate_proj": "column", "*.mlp.up_proj": "column",
            "*.mlp.down_proj": "row", "*.self_attn": Divide("n_heads")}
    sliced = parallelize(copy.deepcopy(dense), plan, tp)
    x = torch.randn(2, SEQ, D, generator=torch.Generator().manual_seed(1))
    outs = []
    for model in (dense, sliced):
        xi = x.clone().requires_grad_(True)
        y = model(xi)
        (y * torch.linspace(-1, 1, D)).sum().backward()
        outs.append((y, xi.grad))
    errs = {"out": rel_err(outs[1][0], outs[0][0]), "input_grad": rel_err(outs[1][1], outs[0][1])}
    errs.update({f"grad/{k}": v for k, v in grad_errors(sliced, dense, tp).items()})
    errs["local_heads"] = float(sliced[0].self_attn.n_heads != HEADS // tp.size)
    return errs


@pytest.mark.parametrize("n", [2, 4])
def test_parallelize_llama_style_blocks_match_original(n: int) -> None:
    for rank, errs in enumerate(run_ranks(_llama_checks, n, timeout=180)):
        assert errs.pop("local_heads") == 0.0
        assert sum(k.startswith("grad/") for k in errs) == 2 * 9  # 7 linears + 2 norms per block
        for name, err in errs.items():
            assert err <= TOL, f"tp={n} rank {rank}: {name} relative error {err:.3e}"
