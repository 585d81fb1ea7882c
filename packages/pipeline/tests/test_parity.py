"""Pipelined training on 2 and 4 real ranks equals one process: loss and every gradient.

One spawned job per pipeline size runs every schedule (GPipe, 1F1B,
interleaved 1F1B), with and without tied embedding/head weights and with and
without activation checkpointing, over three steps: the first negotiates
activation shapes, the second reuses them, the third changes the sequence
length and must renegotiate. A last run trains with SGD for a few steps and
must follow the one-process loss trajectory. The reference is the same model (same per-layer
seeds, the same tied Parameter) run here in one process, microbatch by
microbatch.

Tolerance: relative error of each gradient tensor (by norm) <= 1e-6 in fp32.
Each stage runs exactly the reference's kernels on the same values; only the
order of summation differs where the tied weight adds its two stages'
contributions (sum over microbatches per stage, then across stages), which
perturbs the last bits (fp32 epsilon is 6e-8).
"""

from __future__ import annotations

from functools import cache

import torch

from capstan.comm.testing import requires_mpirun, run_mpirun, run_ranks
from capstan.pipeline.stages.partition import build_layers, partition, tie_layers
from capstan.pipeline.testing_models import gpt_loss, gpt_specs

VOCAB, HIDDEN, BLOCKS, HEADS, SEQ, BATCH = 64, 32, 6, 4, 8, 2
# (schedule, chunks, tied, checkpoint)
CONFIGS = [
    ("gpipe", 1, False, False),
    ("1f1b", 1, False, False),
    ("interleaved-1f1b", 2, False, False),
    ("1f1b", 1, True, False),
    ("gpipe", 1, True, True),
    ("1f1b", 1, False, True),
    ("interleaved-1f1b", 2, True, True),
]
STEPS = [(SEQ, 0), (SEQ, 1), (SEQ - 2, 2)]  # (sequence length, data seed) per step


def _specs(tied: bool):
    return gpt_specs(vocab=VOCAB, hidden=HIDDEN, layers=BLOCKS, heads=HEADS, seq=SEQ, tied=tied)


def _data(m: int, seq: int, seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    xs = [torch.randint(0, VOCAB, (BATCH, seq), generator=g) for _ in range(m)]
    ys = [torch.randint(0, VOCAB, (BATCH, seq), generator=g) for _ in range(m)]
    return xs, ys


def _pipelined(pp: int, m: int) -> list:
    from capstan import comm
    from capstan.pipeline import PipelineExecutor, make_schedule

    groups = comm.build_groups(comm.Topology(pp=pp))
    out = []
    headers = set()
    for name, chunks, tied, ckpt in CONFIGS:
        plan = partition(_specs(tied), pp * chunks, "parameters")
        ex = PipelineExecutor(
            plan, make_schedule(name, pp, m, chunks), groups, gpt_loss, seed=7, checkpoint=ckpt
        )
        headers.add(id(ex.header_group))
        steps = []
        for seq, seed in STEPS:
            xs, ys = _data(m, seq, seed)
            loss = ex.step(xs, ys)
            grads = {
                n: p.grad.clone()
                for c in ex.chunks
                for n, p in c.named_parameters(remove_duplicate=False)
            }
            steps.append((loss, grads))
        out.append(steps)
    # every executor of these groups shares one header group (transport.subgroups): torch keeps each group
    # it makes to the world's end, a gloo one with a thread that wakes every 10 ms
    out.append(len(headers) == 1)
    out.append(_most_sends_held(groups, pp))
    out.append(_trajectory(groups, pp, m))
    return out


def _most_sends_held(groups, pp: int) -> int:
    """The most activations and activation gradients alive at once in this stage's sends over a 1F1B step
    of 4 pp micro-batches, where a send's handle holds its tensor until waited, as NCCL's work does (it
    stashes a collective's tensors for the caching allocator until wait; gloo's frees them on completion,
    so each handle here holds its sends' tensors itself). A send kept to the step's end would hold every
    micro-batch's boundary tensor, GPipe's memory in a 1F1B schedule."""
    from torch.multiprocessing.reductions import StorageWeakRef

    from capstan import comm
    from capstan.pipeline import PipelineExecutor, make_schedule

    class Holding:  # the handle of comm.exchange, holding its tensors until waited
        def __init__(self, handle, tensors: list[torch.Tensor]) -> None:  # noqa: ANN001
            self.handle, self.tensors = handle, tensors

        def is_completed(self) -> bool:
            return self.handle.is_completed()

        def wait(self) -> None:
            self.handle.wait()
            self.tensors = []

    m = 4 * pp
    ex = PipelineExecutor(partition(_specs(False), pp, "parameters"), make_schedule("1f1b", pp, m), groups,
                          gpt_loss, seed=7)
    sent: list[StorageWeakRef] = []  # (the storage: a work keeps the tensor, not the Python object)
    most = 0
    exchange = comm.exchange

    def holding(ops, group=None):  # noqa: ANN001, ANN202 - comm.exchange's signature
        nonlocal most
        most = max(most, sum(not r.expired() for r in sent))
        floats = [op.tensor for op in ops if op.kind == "send" and op.tensor.is_floating_point()]
        sent.extend(StorageWeakRef(x.untyped_storage()) for x in floats)
        return Holding(exchange(ops, group=group), floats)

    comm.exchange = holding
    try:
        ex.step(*_data(m, SEQ, 0))
    finally:
        comm.exchange = exchange
    return most


TRAJECTORY_STEPS = 8


def _sgd(params):
    return torch.optim.SGD(params, lr=0.5, momentum=0.9)


def _trajectory(groups, pp: int, m: int) -> list[float | None]:
    """Losses of TRAJECTORY_STEPS optimizer steps (1F1B, tied, checkpointed) on fixed data."""
    from capstan.pipeline import PipelineExecutor, make_schedule

    plan = partition(_specs(True), pp, "parameters")
    ex = PipelineExecutor(
        plan,
        make_schedule("1f1b", pp, m),
        groups,
        gpt_loss,
        seed=7,
        checkpoint=True,
        optimizer_factory=_sgd,
    )
    xs, ys = _data(m, SEQ, 0)
    return [ex.step(xs, ys) for _ in range(TRAJECTORY_STEPS)]


def _reference_trajectory(m: int) -> list[float]:
    specs = _specs(True)
    layers = build_layers(specs, range(len(specs)), seed=7)
    tie_layers(specs, layers)
    model = torch.nn.Sequential(*layers)
    opt = _sgd(model.parameters())
    xs, ys = _data(m, SEQ, 0)
    losses = []
    for _ in range(TRAJECTORY_STEPS):
        opt.zero_grad(set_to_none=True)
        total = 0.0
        for x, y in zip(xs, ys, strict=True):
            loss = gpt_loss(model(x), y) / m
            loss.backward()
            total += float(loss.detach())
        opt.step()
        losses.append(total)
    return losses


@cache
def _reference(tied: bool, m: int, seq: int, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    specs = _specs(tied)
    layers = build_layers(specs, range(len(specs)), seed=7)
    tie_layers(specs, layers)
    model = torch.nn.Sequential(*layers)
    total = 0.0
    for x, y in zip(*_data(m, seq, seed), strict=True):
        loss = gpt_loss(model(x), y) / m
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}


def _pipelined_over_mpi(pp: int, m: int) -> list:
    """`_pipelined` on the mpi backend; fails unless the stages' exchanges take MPI point-to-point."""
    from capstan import comm
    from capstan.comm.backends import mpi_backend

    assert comm.backend() == "mpi", comm.backend()
    pp_group = comm.build_groups(comm.Topology(pp=pp)).pp
    assert mpi_backend.p2p_ok(pp_group)
    return _pipelined(pp, m)


def _check(pp: int, m: int, over_mpi: bool = False) -> None:
    if over_mpi:
        results = run_mpirun(_pipelined_over_mpi, pp, pp, m, timeout=300)
    else:
        results = run_ranks(_pipelined, pp, pp, m, timeout=240)
    _check_trajectory(results, pp, m)
    _check_sends_held(results, pp, over_mpi)
    assert all(r[len(CONFIGS)] for r in results), "a header group per executor, not one for all"
    for ci, (name, chunks, tied, ckpt) in enumerate(CONFIGS):
        for si, (seq, seed) in enumerate(STEPS):
            tag = f"pp={pp} {name} chunks={chunks} tied={tied} checkpoint={ckpt} step={si}"
            want_loss, want = _reference(tied, m, seq, seed)
            got: dict[str, torch.Tensor] = {}
            losses = [results[r][ci][si][0] for r in range(pp)]
            assert losses[:-1] == [None] * (pp - 1), tag  # only the last stage reports the loss
            assert abs(losses[-1] - want_loss) <= 1e-6 * abs(want_loss), (
                tag,
                losses[-1],
                want_loss,
            )
            for r in range(pp):
                for n, g in results[r][ci][si][1].items():
                    assert n not in got, f"{tag}: {n} on two stages"
                    got[n] = g
            assert sorted(got) == sorted(want), tag
            for n, g in want.items():
                err = (got[n] - g).norm() / g.norm().clamp_min(1e-30)
                assert err <= 1e-6, f"{tag}: gradient of {n} off by {err:.2e} (relative)"


def _check_sends_held(results: list, pp: int, over_mpi: bool) -> None:
    """1F1B keeps a stage's in-flight micro-batches alive, and a batch of sends that also receives is
    waited at once; the warm-up's sends alone are left in flight. Where a send's completion can be seen
    (MPI's requests here, NCCL's events on a GPU) the executor retires them as the step goes: measured at
    pp 2 over MPI, 1 boundary tensor at most on the first stage, 2 when they waited for the step's end.
    gloo's sends tell their completion only when waited: there the bound is the in-flight one (measured
    2 at pp 2, 6 at pp 4)."""
    held = [r[-2] for r in results]
    most = pp - 1 if over_mpi else 2 * pp
    assert max(held) <= most, f"pp={pp}: sends held {held} boundary tensors at once over {4 * pp} micro-batches"


def _check_trajectory(results: list, pp: int, m: int) -> None:
    # Invariant 1 of ARCHITECTURE.md: the one-process trajectory (fp32, 1e-5 relative).
    got = results[-1][-1]
    assert [r[-1] for r in results[:-1]] == [[None] * TRAJECTORY_STEPS] * (pp - 1)
    want = _reference_trajectory(m)
    assert want[-1] < want[0] - 0.1  # the run really trains (not a flat trajectory)
    for step, (a, b) in enumerate(zip(got, want, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), f"pp={pp} step {step}: loss {a} vs one process {b}"


def test_two_stages_match_one_process() -> None:
    _check(2, 4)


def test_four_stages_match_one_process() -> None:
    _check(4, 8)


@requires_mpirun()
def test_two_stages_over_mpi_point_to_point_match_one_process() -> None:
    """Under mpirun the activations and gradients travel by MPI_Isend/Irecv: same losses and gradients."""
    _check(2, 4, over_mpi=True)


def _two_replicas() -> list:
    """dp=2 x pp=2: two pipelines side by side, each with its own tied and header groups."""
    from capstan import comm
    from capstan.pipeline import PipelineExecutor, make_schedule

    groups = comm.build_groups(comm.Topology(dp=2, pp=2))
    out = []
    for name, chunks in (("1f1b", 1), ("interleaved-1f1b", 2)):
        plan = partition(_specs(True), 2 * chunks, "parameters")
        ex = PipelineExecutor(plan, make_schedule(name, 2, 4, chunks), groups, gpt_loss, seed=7)
        xs, ys = _data(4, SEQ, groups.dp.rank)  # each replica trains on its own data
        loss = ex.step(xs, ys)
        grads = {
            n: p.grad.clone()
            for c in ex.chunks
            for n, p in c.named_parameters(remove_duplicate=False)
        }
        out.append((groups.dp.rank, groups.pp.rank, loss, grads))
    return out


def test_pipelines_of_two_data_parallel_replicas_each_match_one_process() -> None:
    results = run_ranks(_two_replicas, 4, timeout=240)
    for ci in range(2):
        for replica in range(2):
            want_loss, want = _reference(True, 4, SEQ, replica)
            stages = sorted((r[ci] for r in results if r[ci][0] == replica), key=lambda t: t[1])
            assert [s[1] for s in stages] == [0, 1]
            assert stages[0][2] is None and abs(stages[1][2] - want_loss) <= 1e-6 * want_loss
            got = {**stages[0][3], **stages[1][3]}
            assert sorted(got) == sorted(want)
            for n, g in want.items():
                assert (got[n] - g).norm() <= 1e-6 * g.norm(), (ci, replica, n)
