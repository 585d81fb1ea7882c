"""CommError and the liveness records that let it name a lost peer.

A collective that fails (a peer died, or nobody answered within the
configured timeout) raises `CommError` naming the operation, the group and,
where it can be told, the lost peer. To tell which peer is gone every rank
publishes its host and pid at start-up and refreshes a heartbeat file or
store key every `HEARTBEAT_S` seconds; after a failure the survivors look
for a peer whose process is gone (same host) or whose heartbeat went stale.

A peer that is gone is not necessarily lost: a survivor that raised a
CommError naming lost ranks exits too, and with collectives in flight another
survivor may notice that exit first. So a rank that names lost ranks
publishes that verdict (`publish_verdict`) before it raises, and `find_lost`
counts a gone peer with a published verdict as a survivor and adopts its lost
ranks instead (the union with any peer that died without one). Verdicts are
also polled by the heartbeat thread, so one published by the rank that serves
the store is still known after that rank exited (it lingers briefly to let
the others see it).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from pathlib import Path

from .procmem import pid_alive

__all__ = ["CommError", "Liveness", "StoreLiveness", "DirLiveness"]

HEARTBEAT_S = 0.5
STALE_S = 3.0
VERDICT_LINGER_S = 3 * HEARTBEAT_S  # the store's server waits at most this long for the others to read its verdict


class CommError(RuntimeError):
    """A collective or point-to-point operation failed or timed out."""

    def __init__(self, op: str, group: str, detail: str, lost: Sequence[int] = ()) -> None:
        self.op, self.group, self.lost = op, group, list(lost)
        who = f"lost rank(s) {self.lost}" if self.lost else "no peer identified as lost"
        super().__init__(f"{op} on group {group} failed: {detail} ({who})")


class Liveness:
    """Publishes this rank's heartbeat and finds dead peers after a failure."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.host = socket.gethostname()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.verdicts: dict[int, list[int]] = {}  # rank -> the lost ranks it published before exiting
        self.failed: set[int] = set()  # peers that announced an exit on an error of their own (announce_failure)

    # Subclasses store and fetch (host, pid, time) records per rank.
    def _publish(self, record: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _fetch(self, rank: int) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    # ... and verdicts: the lost ranks a rank named before it exited.
    def _put_verdict(self, text: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _get_verdict(self, rank: int, poller: bool = False) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

    def _poll_verdicts(self) -> None:
        """Called every heartbeat; caches peers' verdicts while they can still be read."""

    def publish_verdict(self, lost: Sequence[int]) -> None:
        """Record that this rank is exiting because `lost` are gone; never raises, never hangs."""
        lost = sorted({int(r) for r in lost} - {self.rank})
        if not lost:
            return
        try:
            self._put_verdict(",".join(map(str, lost)))
        except Exception:
            return
        self._linger(lost)

    def _linger(self, lost: list[int]) -> None:
        """Hook for the rank whose exit takes the verdicts with it (the store's server)."""

    def announce_failure(self) -> None:
        """Record that this rank is exiting on an error of its own; never raises, never hangs.

        A peer blocked in a collective with it can then fail at once, naming it, rather than wait
        out the timeout: under mpirun a rank that exits cleanly (MPI_Finalize at exit) leaves the
        job running, and its process stays alive in MPI_Finalize's fence, so nothing else tells.
        Peers learn it from their heartbeat thread's poll (`failed`).
        """
        try:
            self._put_failure()
        except Exception:
            return

    def _put_failure(self) -> None:
        """Subclasses publish the failure notice where `_poll_verdicts` finds it (default: nowhere)."""

    def _verdict(self, rank: int, poller: bool = False) -> list[int] | None:
        if rank in self.verdicts:
            return self.verdicts[rank]
        try:
            text = self._get_verdict(rank, poller)
        except Exception:
            return None
        if text is None:
            return None
        try:
            found = [int(r) for r in text.split(",") if r.strip()]
        except ValueError:
            return None
        self.verdicts[rank] = found
        return found

    def start(self) -> None:
        self._beat()
        self._thread = threading.Thread(target=self._run, name="capstan-heartbeat", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop beating and wait for the thread: a store client destroyed at interpreter exit
        while the thread is inside it aborts the process ("terminate called ...")."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * HEARTBEAT_S)

    def _beat(self) -> None:
        self._publish(f"{self.host} {os.getpid()} {time.time():.3f}")

    def _run(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._beat()
                self._poll_verdicts()
            except Exception:  # the store's host may be gone; the failure path reports it
                return

    def _is_dead(self, rank: int, now: float) -> bool:
        try:
            record = self._fetch(rank)
        except Exception:
            return rank == 0  # the store lives on rank 0: unreachable means rank 0 is gone
        if record is None:
            return False
        host, pid, stamp = record.split()
        if host == self.host and not pid_alive(int(pid)):
            return True
        return now - float(stamp) > STALE_S

    def find_lost(self, ranks: Sequence[int], wait_s: float = STALE_S + HEARTBEAT_S) -> list[int]:
        """Peers among `ranks` that are gone; waits up to `wait_s` for a stale heartbeat.

        A gone peer that published a verdict exited on a failure of its own: it
        is not lost, and the ranks it named are (see the module docstring).
        """
        deadline = time.monotonic() + wait_s
        while True:
            now = time.time()
            lost: set[int] = set()
            for r in ranks:
                if r == self.rank:
                    continue
                # A verdict is published before its rank exits, so look for it after finding the rank gone.
                if (r in self.verdicts or self._is_dead(r, now)) and self._verdict(r) is None:
                    lost.add(r)
            for named in list(self.verdicts.values()):  # adopt every verdict seen, including the polled ones
                lost.update(named)
            lost.discard(self.rank)
            if lost or time.monotonic() >= deadline:
                return sorted(lost)
            time.sleep(HEARTBEAT_S / 2)


class StoreLiveness(Liveness):
    """Heartbeats in a torch.distributed store (a client of its own, so threads never share one).

    Verdicts live under ``capstan/lost/<rank>`` (failure notices under ``capstan/failed/<rank>``);
    ``capstan/lost/n`` counts both and ``capstan/lost/seq/<i>`` names the i-th publisher, so the
    heartbeat thread polls one counter per beat. A peer that cached rank r's verdict bumps
    ``capstan/lost/ack/<r>``: the store's server (`serves_store`) lingers until
    every other survivor of a world of `world_size` did, or `VERDICT_LINGER_S`.
    """

    def __init__(self, rank: int, make_store: Callable[[], object], world_size: int | None = None,
                 serves_store: bool = False) -> None:
        super().__init__(rank)
        self.world_size, self.serves_store = world_size, serves_store
        self._writer = make_store()
        self._reader = make_store()
        for client in (self._writer, self._reader):  # liveness store ops must fail fast, never hang
            try:
                client.set_timeout(timedelta(seconds=2 * HEARTBEAT_S + 1))  # type: ignore[attr-defined]
            except Exception:
                pass
        self._lock = threading.Lock()  # the reader serves find_lost and publish_verdict, from any thread
        self._seen = 0

    def _publish(self, record: str) -> None:
        self._writer.set(f"capstan/alive/{self.rank}", record)  # type: ignore[attr-defined]

    def _fetch(self, rank: int) -> str | None:
        key = f"capstan/alive/{rank}"
        with self._lock:
            if not self._reader.check([key]):  # type: ignore[attr-defined]
                return None
            return self._reader.get(key).decode()  # type: ignore[attr-defined]

    def _put_verdict(self, text: str) -> None:
        with self._lock:
            self._reader.set(f"capstan/lost/{self.rank}", text)  # type: ignore[attr-defined]
            i = self._reader.add("capstan/lost/n", 1)  # type: ignore[attr-defined]
            self._reader.set(f"capstan/lost/seq/{i}", str(self.rank))  # type: ignore[attr-defined]

    def _put_failure(self) -> None:
        # In the verdicts' sequence, so the peers' heartbeat poll (one counter per beat) finds it.
        with self._lock:
            self._reader.set(f"capstan/failed/{self.rank}", "1")  # type: ignore[attr-defined]
            i = self._reader.add("capstan/lost/n", 1)  # type: ignore[attr-defined]
            self._reader.set(f"capstan/lost/seq/{i}", str(self.rank))  # type: ignore[attr-defined]

    def _get_verdict(self, rank: int, poller: bool = False) -> str | None:
        key = f"capstan/lost/{rank}"
        if poller:
            client = self._writer
            return client.get(key).decode() if client.check([key]) else None  # type: ignore[attr-defined]
        with self._lock:
            client = self._reader
            return client.get(key).decode() if client.check([key]) else None  # type: ignore[attr-defined]

    def _poll_verdicts(self) -> None:
        client = self._writer
        n = client.add("capstan/lost/n", 0)  # type: ignore[attr-defined]
        while self._seen < n:
            key = f"capstan/lost/seq/{self._seen + 1}"
            if not client.check([key]):  # type: ignore[attr-defined]
                return  # published but not yet named: the next beat
            rank = int(client.get(key).decode())  # type: ignore[attr-defined]
            self._seen += 1
            if rank != self.rank and client.check([f"capstan/failed/{rank}"]):  # type: ignore[attr-defined]
                self.failed.add(rank)
            if rank != self.rank and rank not in self.verdicts and self._verdict(rank, poller=True) is not None:
                client.add(f"capstan/lost/ack/{rank}", 1)  # type: ignore[attr-defined]

    def _linger(self, lost: list[int]) -> None:
        if not self.serves_store:
            return
        want = None if self.world_size is None else self.world_size - 1 - len(lost)
        deadline = time.monotonic() + VERDICT_LINGER_S
        while time.monotonic() < deadline:
            try:
                with self._lock:
                    acks = self._reader.add(f"capstan/lost/ack/{self.rank}", 0)  # type: ignore[attr-defined]
            except Exception:
                return
            if want is not None and acks >= want:
                return
            time.sleep(HEARTBEAT_S / 5)


class DirLiveness(Liveness):
    """Heartbeats as files in a shared directory (the file-rendezvous test harness)."""

    def __init__(self, rank: int, directory: str | os.PathLike[str]) -> None:
        super().__init__(rank)
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def _publish(self, record: str) -> None:
        tmp = self.dir / f".alive.{self.rank}.tmp"
        tmp.write_text(record)
        os.replace(tmp, self.dir / f"alive.{self.rank}")

    def _fetch(self, rank: int) -> str | None:
        try:
            return (self.dir / f"alive.{rank}").read_text() or None
        except FileNotFoundError:
            return None

    def _put_verdict(self, text: str) -> None:
        tmp = self.dir / f".lost.{self.rank}.tmp"
        tmp.write_text(text)
        os.replace(tmp, self.dir / f"lost.{self.rank}")

    def _get_verdict(self, rank: int, poller: bool = False) -> str | None:
        try:
            return (self.dir / f"lost.{rank}").read_text()
        except FileNotFoundError:
            return None
