"""CommError and the liveness records that let it name a lost peer.

A collective that fails (a peer died, or nobody answered within the
configured timeout) raises `CommError` naming the operation, the group and,
where it can be told, the lost peer. To tell which peer is gone every rank
publishes its host and pid at start-up and refreshes a heartbeat file or
store key every `HEARTBEAT_S` seconds; after a failure the survivors look
for a peer whose process is gone (same host) or whose heartbeat went stale.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

__all__ = ["CommError", "Liveness", "StoreLiveness", "DirLiveness"]

HEARTBEAT_S = 0.5
STALE_S = 3.0


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

    # Subclasses store and fetch (host, pid, time) records per rank.
    def _publish(self, record: str) -> None:  # pragma: no cover - interface
        raise NotImplementedError

    def _fetch(self, rank: int) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError

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
        if host == self.host:
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                return True
            except PermissionError:
                pass
        return now - float(stamp) > STALE_S

    def find_lost(self, ranks: Sequence[int], wait_s: float = STALE_S + HEARTBEAT_S) -> list[int]:
        """Peers among `ranks` that are gone; waits up to `wait_s` for a stale heartbeat."""
        deadline = time.monotonic() + wait_s
        while True:
            now = time.time()
            lost = [r for r in ranks if r != self.rank and self._is_dead(r, now)]
            if lost or time.monotonic() >= deadline:
                return lost
            time.sleep(HEARTBEAT_S / 2)


class StoreLiveness(Liveness):
    """Heartbeats in a torch.distributed store (a client of its own, so threads never share one)."""

    def __init__(self, rank: int, make_store: Callable[[], object]) -> None:
        super().__init__(rank)
        self._writer = make_store()
        self._reader = make_store()

    def _publish(self, record: str) -> None:
        self._writer.set(f"capstan/alive/{self.rank}", record)  # type: ignore[attr-defined]

    def _fetch(self, rank: int) -> str | None:
        key = f"capstan/alive/{rank}"
        if not self._reader.check([key]):  # type: ignore[attr-defined]
            return None
        return self._reader.get(key).decode()  # type: ignore[attr-defined]


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
