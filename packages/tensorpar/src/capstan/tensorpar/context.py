"""Context parallelism: one sequence split over the ranks of a `cp` group, attention across the split.

    cp = ContextParallel(groups.cp, "ring")          # or "ulysses"
    ids_mine = cp.shard(ids)                         # [b, s] -> this rank's [b, s / cp] tokens
    y = cp.attention(q, k, v)                        # [b, heads, s / cp, d] each, causal over the whole sequence

Every layer but attention works on tokens independently, so a rank runs the model on its own tokens
only; attention is where the sequence meets itself, done one of two ways (`parallel.cp_mode`):

* **Ulysses** (Jacobs et al. 2023, DeepSpeed-Ulysses): an all-to-all turns the sequence-split q, k, v
  into head-split ones holding the whole sequence (heads / cp each), ordinary causal attention runs,
  and a second all-to-all turns the output back. Two all-to-alls of the activations per attention,
  whatever cp; the heads (per tensor-parallel rank) must divide by cp. Rank r holds the contiguous
  tokens [r s/cp, (r + 1) s/cp).
* **Ring** (Liu et al. 2023, ring attention; the load balancing of Megatron's and torchtitan's
  context parallelism): key/value blocks travel around the cp ring while each rank attends its
  queries to the block in hand, accumulating with an online softmax (Milakov & Gimelshein 2018:
  running max and sum rescaled per block) so the full [s x s] scores never exist; the next block's
  send and receive are posted before the current block is computed. With a causal mask a contiguous
  split would give the last rank all the work, so the sequence is cut into 2 cp chunks and rank r
  holds chunks r and 2 cp - 1 - r: every rank then computes the same number of unmasked chunk
  pairs. Backward passes the blocks around again with their key/value gradients, which arrive home
  after a last hop. The sequence must divide by 2 cp; heads need not divide by cp. Each chunk pair is
  computed in tiles of `ring_tile` queries x `ring_tile` keys (flash attention's tiling, with the
  same online softmax), so a rank's scores are ring_tile^2 per head however long the sequence. A
  tile's softmax steps run in place (`_scores`), so forward holds one tile of scores and backward two;
  one tensor per step left up to six alive and fragmented the heap (docs/plan.md, model D).

`positions` gives a rank's token positions (the position embedding and the loss use them), `shard`
takes a rank's tokens out of a full sequence, `gather` puts the ranks' tokens back in order (tests).
On a group of one everything is the identity and attention is PyTorch's fused causal kernel.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from capstan import comm
from capstan.comm import Group

__all__ = ["ContextParallel", "CP_MODES", "check_context_sizes", "cp_positions"]

CP_MODES = ("ulysses", "ring")


def cp_positions(rank: int, size: int, local: int, mode: str) -> list[int]:
    """Positions (in the whole sequence of size x local tokens) of rank `rank`'s `local` tokens."""
    if mode == "ulysses" or size == 1:
        return list(range(rank * local, (rank + 1) * local))
    c = local // 2
    first, second = rank, 2 * size - 1 - rank
    return list(range(first * c, (first + 1) * c)) + list(range(second * c, (second + 1) * c))


def check_context_sizes(seq: int, heads: int, size: int, mode: str) -> None:
    """A ValueError naming what does not split (heads: per tensor-parallel rank)."""
    if mode not in CP_MODES:
        raise ValueError(f"cp mode {mode!r}: expected one of {', '.join(CP_MODES)}")
    if size == 1:
        return
    if mode == "ring" and seq % (2 * size):
        raise ValueError(f"ring attention needs the sequence ({seq} tokens) to divide by 2 x cp = {2 * size} "
                         "(each rank holds two mirrored chunks)")
    if mode == "ulysses" and seq % size:
        raise ValueError(f"Ulysses attention needs the sequence ({seq} tokens) to divide by cp = {size}")
    if mode == "ulysses" and heads % size:
        raise ValueError(f"Ulysses attention needs the attention heads per tensor-parallel rank ({heads}) to divide "
                         f"by cp = {size} (it splits heads across the cp group); use cp_mode = \"ring\" or another cp")


RING_TILE = 1024  # a tile's scores: 4 MiB per head in fp32


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """A cp group and how attention crosses it (module docstring)."""

    group: Group
    mode: str = "ulysses"
    ring_tile: int = RING_TILE
    """Ring mode: queries and keys per tile of a chunk pair, so at most ring_tile^2 scores per head exist."""

    _positions: dict[tuple[int, str], torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    """`positions`' tensors by (tokens per rank, device)."""

    def __post_init__(self) -> None:
        if self.mode not in CP_MODES:
            raise ValueError(f"cp mode {self.mode!r}: expected one of {', '.join(CP_MODES)}")

    @classmethod
    def of(cls, group: Group, mode: str) -> ContextParallel | None:
        """The context of a cp group, or None for a group of one (nothing to split)."""
        return cls(group, mode) if group.size > 1 else None

    @property
    def size(self) -> int:
        return self.group.size

    def positions(self, local: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """This rank's token positions, for `local` tokens per rank: made once per size and device, since
        a tensor made from a Python list on an accelerator is a blocking copy from pageable memory (the
        host waits for the device), and the GPT's forward and the sharding of its inputs and targets ask
        every micro-batch (never written to: callers index with it)."""
        key = (local, str(torch.device(device)))
        cached = self._positions.get(key)
        if cached is None:
            cached = torch.tensor(cp_positions(self.group.rank, self.size, local, self.mode), device=device)
            if not torch.is_inference_mode_enabled():  # (an inference tensor cannot index a training forward)
                self._positions[key] = cached
        return cached

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's tokens of a whole-sequence tensor (along `dim`)."""
        if self.size == 1:
            return x
        seq = x.shape[dim]
        if seq % (2 * self.size if self.mode == "ring" else self.size):
            check_context_sizes(seq, self.size, self.size, self.mode)
        index = self.positions(seq // self.size, x.device)
        return x.index_select(dim, index)

    def gather(self, parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
        """The whole sequence from every rank's tokens (`parts` in rank order)."""
        local = parts[0].shape[dim]
        order = [p for r in range(len(parts)) for p in cp_positions(r, len(parts), local, self.mode)]
        whole = torch.cat(parts, dim)
        inverse = torch.empty(len(order), dtype=torch.long)
        inverse[torch.tensor(order)] = torch.arange(len(order))
        return whole.index_select(dim, inverse.to(whole.device))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of this rank's queries over the whole sequence: [b, heads, s/cp, d] each."""
        if self.size == 1:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if self.mode == "ulysses":
            q, k, v = (_SeqToHeads.apply(t, self.group) for t in (q, k, v))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return _HeadsToSeq.apply(y, self.group)
        return _RingAttention.apply(q, k, v, self.group, self.ring_tile)


# ---- Ulysses: all-to-all between sequence-split and head-split ------------------------------------------
def _seq_to_heads(x: torch.Tensor, group: Group) -> torch.Tensor:
    """[b, h, s/n, d] (this rank's tokens, every head) -> [b, h/n, s, d] (every token, this rank's heads)."""
    n = group.size
    b, h, s, d = x.shape
    send = x.reshape(b, n, h // n, s, d).transpose(0, 1).contiguous()  # part i: the heads rank i will hold
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group)  # part j: rank j's tokens of my heads
    return recv.permute(1, 2, 0, 3, 4).reshape(b, h // n, n * s, d)


def _heads_to_seq(x: torch.Tensor, group: Group) -> torch.Tensor:
    """The inverse: [b, h/n, s, d] -> [b, h, s/n, d]."""
    n = group.size
    b, hn, s, d = x.shape
    send = x.reshape(b, hn, n, s // n, d).permute(2, 0, 1, 3, 4).contiguous()  # part i: rank i's tokens
    recv = torch.empty_like(send)
    comm.all_to_all(recv, send, group)  # part j: my tokens of rank j's heads
    return recv.transpose(0, 1).reshape(b, n * hn, s // n, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _seq_to_heads(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _heads_to_seq(grad.contiguous(), ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group: Group) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return _heads_to_seq(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        return _seq_to_heads(grad.contiguous(), ctx.group), None


# ---- Ring: key/value blocks around the cp ring, online softmax ------------------------------------------
def _chunks(rank: int, n: int) -> tuple[int, int]:
    """The two sequence chunks (of 2n) rank `rank` holds."""
    return rank, 2 * n - 1 - rank


def _pairs(me: int, src: int, n: int) -> list[tuple[int, int, bool]]:
    """(my chunk slot, their chunk slot, diagonal) of the chunk pairs with anything unmasked: my queries
    of chunk a attend their keys of chunk b when b <= a (b == a: the causal triangle)."""
    mine, theirs = _chunks(me, n), _chunks(src, n)
    return [(i, j, a == b) for i, a in enumerate(mine) for j, b in enumerate(theirs) if b <= a]


def _exchange(tensor: torch.Tensor, group: Group) -> tuple[torch.Tensor, comm.P2PHandle]:
    """Post sending `tensor` to the next rank of the ring and receiving the previous rank's."""
    n, r = group.size, group.rank
    recv = torch.empty_like(tensor)
    handle = comm.exchange([comm.P2POp("send", tensor, (r + 1) % n), comm.P2POp("recv", recv, (r - 1) % n)], group)
    return recv, handle


class _RingAttention(torch.autograd.Function):
    """Causal attention over the cp ring (module docstring); q, k, v: [b, h, 2c, d], two chunks of c."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: Group,  # type: ignore[override]
                tile: int) -> torch.Tensor:
        n, me = group.size, group.rank
        c = q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        qs = (q[:, :, :c], q[:, :, c:])
        dtype = torch.float32
        out = [torch.zeros(*qs[0].shape, dtype=dtype, device=q.device) for _ in range(2)]
        run_max = [torch.full(qs[0].shape[:-1], float("-inf"), dtype=dtype, device=q.device) for _ in range(2)]
        run_sum = [torch.zeros(qs[0].shape[:-1], dtype=dtype, device=q.device) for _ in range(2)]
        kv = torch.stack((k, v)).contiguous()
        for step in range(n):
            src = (me - step) % n
            pending = _exchange(kv, group) if step < n - 1 else None  # the next block, while this one computes
            for i, j, diag in _pairs(me, src, n):
                for qa, qb, ka, kb, mask in _tiles(c, tile, diag, q.device):
                    kt, vt = kv[0, :, :, j * c + ka:j * c + kb], kv[1, :, :, j * c + ka:j * c + kb]
                    s = _scores(qs[i][:, :, qa:qb], kt, scale, mask, dtype)
                    old_max = run_max[i][:, :, qa:qb]
                    new_max = torch.maximum(old_max, s.amax(-1))
                    p = s.sub_(new_max.unsqueeze(-1)).exp_()  # in place: one tile of scores alive at a time
                    rescale = torch.exp(old_max - new_max)
                    run_sum[i][:, :, qa:qb] = run_sum[i][:, :, qa:qb] * rescale + p.sum(-1)
                    out[i][:, :, qa:qb] = (out[i][:, :, qa:qb] * rescale.unsqueeze(-1)
                                           + torch.matmul(p.to(vt.dtype), vt).to(dtype))
                    run_max[i][:, :, qa:qb] = new_max
            if pending is not None:
                recv, handle = pending
                handle.wait()
                kv = recv
        y = torch.cat([o / s.unsqueeze(-1) for o, s in zip(out, run_sum)], 2).to(q.dtype)
        lse = torch.cat([m + torch.log(s) for m, s in zip(run_max, run_sum)], 2)  # [b, h, 2c]
        ctx.save_for_backward(q, k, v, y, lse)
        ctx.group, ctx.tile = group, tile
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        q, k, v, y, lse = ctx.saved_tensors
        group = ctx.group
        n, me = group.size, group.rank
        c = q.shape[2] // 2
        scale = 1.0 / math.sqrt(q.shape[-1])
        dtype = torch.float32
        grad = grad.contiguous()
        delta = (grad.to(dtype) * y.to(dtype)).sum(-1)  # [b, h, 2c]: rowsum(dO * O)
        dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        dkv = torch.zeros((2, *k.shape), dtype=dtype, device=q.device)
        for step in range(n):
            src = (me - step) % n
            pending = _exchange(kv, group) if step < n - 1 else None
            for i, j, diag in _pairs(me, src, n):
                for qa, qb, ka, kb, mask in _tiles(c, ctx.tile, diag, q.device):
                    rows, cols = slice(i * c + qa, i * c + qb), slice(j * c + ka, j * c + kb)
                    qt, gt = q[:, :, rows], grad[:, :, rows]
                    kt, vt = kv[0, :, :, cols], kv[1, :, :, cols]
                    s = _scores(qt, kt, scale, mask, dtype)
                    p = s.sub_(lse[:, :, rows].unsqueeze(-1)).exp_()  # the forward's probabilities
                    dkv[1, :, :, cols] += torch.matmul(p.transpose(-2, -1), gt.to(dtype))
                    dp = torch.matmul(gt.to(dtype), vt.to(dtype).transpose(-2, -1))
                    ds = dp.sub_(delta[:, :, rows].unsqueeze(-1)).mul_(p).mul_(scale)  # two tiles alive, not six
                    dq[:, :, rows] += torch.matmul(ds, kt.to(dtype))
                    dkv[0, :, :, cols] += torch.matmul(ds.transpose(-2, -1), qt.to(dtype))
            # the block's gradients go on with it; after the last step one more hop brings them home
            recv_dkv, sent = _exchange(dkv, group)
            sent.wait()
            dkv = recv_dkv
            if pending is not None:
                recv, handle = pending
                handle.wait()
                kv = recv
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor | None,
            dtype: torch.dtype) -> torch.Tensor:
    """A tile's scaled, masked scores q k^T in `dtype`, computed in place on a tensor of its own (the
    softmax steps after it work in place too, so a tile costs one [queries x keys] tensor, not one per op)."""
    s = torch.matmul(q, k.transpose(-2, -1)).to(dtype)  # the matmul's own tensor when already `dtype`
    s.mul_(scale)
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    return s


def _tiles(c: int, tile: int, diag: bool, device: torch.device
           ) -> Iterator[tuple[int, int, int, int, torch.Tensor | None]]:
    """(query start, stop, key start, stop, mask) of the tiles of a c x c chunk pair, each at most
    tile x tile scores, keys in ascending order for each query tile (so a row's first tile has a key
    it may see, and the online softmax never meets a row with nothing yet). On the diagonal pair, tiles
    wholly after the queries are skipped and the mask is True where a key comes after its query."""
    for qa in range(0, c, tile):
        qb = min(c, qa + tile)
        for ka in range(0, c, tile):
            kb = min(c, ka + tile)
            if diag and ka >= qb:
                break
            mask = None
            if diag and kb - 1 > qa:
                mask = (torch.arange(ka, kb, device=device).unsqueeze(0)
                        > torch.arange(qa, qb, device=device).unsqueeze(1))
            yield qa, qb, ka, kb, mask
