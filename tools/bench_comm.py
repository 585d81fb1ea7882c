"""Bus bandwidth of capstan's CPU collectives: gloo vs mpi4py vs raw mpi4py, in one run.

Run under mpirun (the mpi path needs an MPI launch)::

    hatch run mpirun -np 2 --oversubscribe python tools/bench_comm.py [--max-mib 256] [--json out.json]

For every size from 4 KiB to --max-mib and every operation (all_reduce,
all_gather, reduce_scatter) it times, interleaved so machine noise hits all
alike: raw mpi4py on numpy arrays (the peer), capstan through its mpi path
(zero-copy numpy views of torch tensors), and capstan through gloo. Bus
bandwidth follows nccl-tests: all_reduce moves 2(n-1)/n of the buffer per
rank, all_gather and reduce_scatter (n-1)/n of the full buffer.
Rank 0 prints a table of medians and the ratio capstan-mpi / raw-mpi4py.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from mpi4py import MPI

from capstan import comm
from capstan.comm.job.groups import Group


def _timed(fn, reps: int) -> float:
    """Median seconds of `reps` calls, each preceded by a barrier so ranks start together."""
    times = []
    for _ in range(reps):
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    # Every rank must agree on the figure: take the slowest rank's median.
    return MPI.COMM_WORLD.allreduce(statistics.median(times), op=MPI.MAX)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-mib", type=int, default=256)
    parser.add_argument("--json", default=None, help="write the rows as JSON here (rank 0)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    world = comm.init(backend="mpi")
    n = world.size
    gloo = Group(name="world-gloo", ranks=world.ranks, rank=world.rank, pg=world.pg, mpi_comm=None)
    mpi_world = MPI.COMM_WORLD
    rows = []
    size = 4 * 1024
    while size <= args.max_mib * 1024 * 1024:
        elems = size // 4
        reps = max(5, min(200, int(2e8 // max(size, 1))))
        t = torch.ones(elems)
        a = t.numpy()
        shard_t = torch.empty(elems // n)
        shard_a = shard_t.numpy()
        full_t = torch.empty(elems * n)
        full_a = full_t.numpy()
        cases = {
            "all_reduce": (
                lambda: mpi_world.Allreduce(MPI.IN_PLACE, a, op=MPI.SUM),
                lambda: comm.all_reduce(t, group=world),
                lambda: comm.all_reduce(t, group=gloo),
                2 * (n - 1) / n * size,
            ),
            "all_gather": (
                lambda: mpi_world.Allgather(a, full_a),
                lambda: comm.all_gather(full_t, t, group=world),
                lambda: comm.all_gather(full_t, t, group=gloo),
                (n - 1) / n * size * n,
            ),
            "reduce_scatter": (
                lambda: mpi_world.Reduce_scatter_block(a, shard_a, op=MPI.SUM),
                lambda: comm.reduce_scatter(shard_t, t, group=world),
                lambda: comm.reduce_scatter(shard_t, t, group=gloo),
                (n - 1) / n * size,
            ),
        }
        for op, (raw, via_mpi, via_gloo, bus_bytes) in cases.items():
            for fn in (raw, via_mpi, via_gloo):
                fn()  # warm-up: connections, page faults
            secs = {"raw": [], "mpi": [], "gloo": []}
            for _ in range(3):  # interleave rounds so drift affects all three alike
                secs["raw"].append(_timed(raw, reps))
                secs["mpi"].append(_timed(via_mpi, reps))
                secs["gloo"].append(_timed(via_gloo, reps))
            med = {k: statistics.median(v) for k, v in secs.items()}
            rows.append({
                "op": op, "bytes": size, "ranks": n,
                **{f"{k}_busbw_GBps": bus_bytes / v / 1e9 for k, v in med.items()},
                "capstan_mpi_vs_raw": med["raw"] / med["mpi"],
                "gloo_vs_raw": med["raw"] / med["gloo"],
            })
        size *= 4
    if world.rank == 0:
        print(f"{'op':<15}{'bytes':>12}{'raw mpi4py':>12}{'capstan mpi':>13}{'capstan gloo':>14}"
              f"{'mpi/raw':>9}{'gloo/raw':>10}   (bus bandwidth GB/s)")
        for r in rows:
            print(f"{r['op']:<15}{r['bytes']:>12}{r['raw_busbw_GBps']:>12.2f}{r['mpi_busbw_GBps']:>13.2f}"
                  f"{r['gloo_busbw_GBps']:>14.2f}{r['capstan_mpi_vs_raw']:>9.2f}{r['gloo_vs_raw']:>10.2f}")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(rows, f, indent=1)
    comm.shutdown()


if __name__ == "__main__":
    main()
