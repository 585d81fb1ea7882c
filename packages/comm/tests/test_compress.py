"""Compressed collectives (comm/ops/compress.py): exact where the compression is lossless, residuals that
keep exactly what was not sent, error feedback that loses nothing over many calls, bytes counted by the
formula. One 4-rank launch checks the world group (4) and the dp groups of a dp 2 x tp 2 topology (2).
"""

from __future__ import annotations

import pytest
import torch

from capstan import comm
from capstan.comm.testing import bytes_written, run_ranks


def test_signs_pack_eight_per_byte_and_come_back() -> None:
    x = torch.randn(64, generator=torch.Generator().manual_seed(0))
    packed = comm.pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == 8
    assert torch.equal(comm.unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))
    with pytest.raises(ValueError, match="multiple of 8"):
        comm.pack_signs(torch.ones(7))


def test_int8_blocks_are_exact_on_their_grid_and_within_half_a_step_off_it() -> None:
    g = torch.Generator().manual_seed(1)
    steps = torch.tensor([0.5, 0.03125]).repeat_interleave(256)
    on_grid = torch.randint(-127, 128, (512,), generator=g).float() * steps
    on_grid[0], on_grid[256] = 127 * 0.5, -127 * 0.03125  # each block's largest sets its scale
    q, scale = comm.quantize_int8(on_grid)
    assert q.dtype == torch.int8 and scale.tolist() == [0.5, 0.03125]
    assert torch.equal(comm.dequantize_int8(q, scale), on_grid)
    x = torch.randn(512, generator=g)
    q, scale = comm.quantize_int8(x)
    err = (comm.dequantize_int8(q, scale) - x).abs().view(2, 256)
    assert bool((err <= scale.unsqueeze(1) / 2 + 1e-7).all())


def _checks(n: int) -> dict:
    torch.set_num_threads(1)
    world = comm.world()
    groups = comm.build_groups(comm.Topology(dp=2, tp=2))
    out = {}
    for name, group in (("world", world), ("dp", groups.dp)):
        w, r = group.size, group.rank
        padded, part = comm.onebit_residual_sizes(n, w)
        res = lambda: (torch.zeros(padded), torch.zeros(part))  # noqa: E731

        # lossless: every rank holds the same +-0.5 tensor; the average is sent exactly, nothing is left over
        same = torch.where(torch.arange(padded) % 3 == 0, 0.5, -0.5)
        wr, sr = res()
        got = comm.onebit_all_reduce(same.clone(), wr, sr, group)
        out[f"{name}/lossless"] = bool(torch.equal(got, same)) and not wr.any() and not sr.any()

        # the worker residual is exactly what the signs and the scale miss
        x = torch.randn(n, generator=torch.Generator().manual_seed(10 + world.rank))
        wr, sr = res()
        comm.reset_wire_bytes()
        comm.onebit_all_reduce(x.clone(), wr, sr, group)
        out[f"{name}/bytes"] = comm.wire_bytes()
        xp = torch.zeros(padded)
        xp[:n] = x
        scale = xp.norm() / xp.numel() ** 0.5
        out[f"{name}/residual"] = float((wr - (xp - scale * torch.where(xp >= 0, 1.0, -1.0))).abs().max())

        # error feedback: the running mean of compressed averages of the same tensors converges to the average
        truth = x.clone()
        comm.all_reduce(truth, "avg", group=group)
        wr, sr = res()
        total = torch.zeros(n)
        for t in range(1, 401):
            total += comm.onebit_all_reduce(x.clone(), wr, sr, group)
            if t in (40, 400):
                out[f"{name}/feedback{t}"] = float(((total / t) - truth).abs().max() / truth.abs().mean())
        one = comm.onebit_all_reduce(x.clone(), *res(), group)  # a single call, for scale
        out[f"{name}/single"] = float((one - truth).abs().max() / truth.abs().mean())

        # int8: on the grid exact, off it within half a step per rank
        k = torch.randint(-127, 128, (n,), generator=torch.Generator().manual_seed(20 + r)).float()
        k[::comm.INT8_BLOCK] = 127  # every block's largest: its scale is 0.25
        shard = k * 0.25
        gathered = torch.empty(n * w)
        comm.reset_wire_bytes()
        comm.quantized_all_gather(gathered, shard, group)
        out[f"{name}/gather_bytes"] = comm.wire_bytes()
        want = torch.empty(n * w)
        comm.all_gather(want, shard, group)
        out[f"{name}/gather_exact"] = bool(torch.equal(gathered, want))
        full = torch.randn(n * w, generator=torch.Generator().manual_seed(30 + r))
        mine = torch.empty(n)
        comm.reset_wire_bytes()
        comm.quantized_reduce_scatter(mine, full, group)
        out[f"{name}/rs_bytes"] = comm.wire_bytes()
        exact = full.clone()
        comm.all_reduce(exact, "sum", group=group)
        half_step = full.abs().max().reshape(1) / 127 / 2  # the largest half step of any block, any rank
        comm.all_reduce(half_step, "max", group=group)
        out[f"{name}/rs_err"] = float((mine - exact[r * n:(r + 1) * n]).abs().max() / (half_step * w))
        grid = torch.zeros(n * w)
        grid[::2] = 0.25 * (r + 1)  # multiples of 0.25, and every block's largest 127 x 0.25: scale 0.25
        for p in range(w):
            for b in range(0, n, comm.INT8_BLOCK):
                grid[p * n + b] = 127 * 0.25
        comm.quantized_reduce_scatter(mine, grid, group)
        exact = grid.clone()
        comm.all_reduce(exact, "sum", group=group)
        out[f"{name}/rs_exact"] = bool(torch.equal(mine, exact[r * n:(r + 1) * n]))
        out.update(_wire_against_the_socket(name, group))
    return out


def _wire_against_the_socket(name: str, group) -> dict:
    """comm.wire_bytes is counted by the code that sends; here it is set beside the bytes that left the
    process during each compressed collective of 1M elements (headers and the barrier's few bytes aside)."""
    n, w = 1 << 20, group.size
    padded, part = comm.onebit_residual_sizes(n, w)
    x = torch.randn(n, generator=torch.Generator().manual_seed(40 + group.rank))
    ops = {"onebit": lambda: comm.onebit_all_reduce(x.clone(), torch.zeros(padded), torch.zeros(part), group),
           "gather": lambda: comm.quantized_all_gather(torch.empty(n * w), x, group),
           "rs": lambda: comm.quantized_reduce_scatter(torch.empty(n // w), x, group)}
    out = {}
    for op, run in ops.items():
        comm.barrier(group)
        comm.reset_wire_bytes()
        before = bytes_written()
        run()
        out[f"{name}/{op}/socket"] = (bytes_written() - before, comm.wire_bytes())
    return out


@pytest.fixture(scope="module")
def results() -> list[dict]:
    return run_ranks(_checks, 4, 1000, timeout=120)


@pytest.mark.parametrize("name", ["world", "dp"])
def test_onebit_is_exact_where_signs_lose_nothing(results: list[dict], name: str) -> None:
    assert all(r[f"{name}/lossless"] for r in results)


@pytest.mark.parametrize("name", ["world", "dp"])
def test_onebit_residual_keeps_what_the_signs_miss(results: list[dict], name: str) -> None:
    assert max(r[f"{name}/residual"] for r in results) <= 1e-6


@pytest.mark.parametrize("name", ["world", "dp"])
def test_error_feedback_loses_nothing_over_many_calls(results: list[dict], name: str) -> None:
    for r in results:
        assert r[f"{name}/single"] > 1.0  # one call alone is far off (signs of random numbers)
        assert r[f"{name}/feedback400"] < 0.3 and r[f"{name}/feedback400"] < r[f"{name}/feedback40"] / 3, r


@pytest.mark.parametrize(("name", "w"), [("world", 4), ("dp", 2)])
def test_bytes_on_the_wire_follow_the_formula(results: list[dict], name: str, w: int) -> None:
    padded, part = comm.onebit_residual_sizes(1000, w)
    onebit = padded // 8 // w * (w - 1) + 4 * (w - 1) + (part // 8 + 4) * (w - 1)
    int8 = (1000 + 4 * 4) * (w - 1)  # 1000 elements in 4 blocks of 256 (the last shorter), a scale each
    for r in results:
        assert r[f"{name}/bytes"] == onebit
        assert r[f"{name}/gather_bytes"] == int8
        assert r[f"{name}/rs_bytes"] == int8  # w parts of 1000 int8 + 4 scales, all but one sent
    ring_fp32 = 2 * (w - 1) / w * 1000 * 4  # what a ring all-reduce of the fp32 tensor sends per rank
    assert ring_fp32 / onebit >= 25  # 32x but for the scales and the padding


@pytest.mark.parametrize("name", ["world", "dp"])
@pytest.mark.parametrize("op", ["onebit", "gather", "rs"])
def test_wire_bytes_are_the_bytes_that_left_the_process(results: list[dict], name: str, op: str) -> None:
    for r in results:
        sent, counted = r[f"{name}/{op}/socket"]
        assert counted > 0 and counted <= sent <= 1.02 * counted + 4096, (sent, counted)


@pytest.mark.parametrize("name", ["world", "dp"])
def test_int8_collectives_exact_on_the_grid_and_close_off_it(results: list[dict], name: str) -> None:
    for r in results:
        assert r[f"{name}/gather_exact"] and r[f"{name}/rs_exact"]
        assert r[f"{name}/rs_err"] <= 1.0
