"""The simulated link's rate (capstan.comm.testing.netns; root only, skipped elsewhere).

tools/bench_slow_network.py's numbers hold only if a link "limited to 100 Mbit/s" carries about
100 Mbit/s: two simulated hosts send each other a plain TCP stream at once (both directions of a
full-duplex link) for about 2 s, and each receiver's measured rate, from its first byte to its
last, must be within 15% of the setting (TCP's payload is ~95% of what tc counts: headers).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from capstan.comm.testing.netns import netns_reason, rate_bits, shaping, simulated_hosts

_REASON = netns_reason()
if _REASON is None and shaping() is None:
    _REASON = "tc cannot shape links here (no netem or tbf)"
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")

RATE = "200mbit"
SECONDS = 2.0
PORT = 29411

_RECEIVE = """
import json, socket, sys, time
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((sys.argv[1], int(sys.argv[2])))
srv.listen(1)
print("listening", flush=True)
conn, _ = srv.accept()
first = conn.recv(1 << 20)
t0 = time.perf_counter()
n, t1 = 0, t0
while True:
    b = conn.recv(1 << 20)
    if not b:
        break
    n += len(b)
    t1 = time.perf_counter()
print(json.dumps({"bytes": n, "seconds": t1 - t0}), flush=True)
"""

_SEND = """
import socket, sys, time
deadline = time.monotonic() + 10
while True:
    try:
        s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
        break
    except OSError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.05)
chunk, left = bytes(1 << 20), int(sys.argv[3])
while left > 0:
    s.sendall(chunk[:left])
    left -= len(chunk)
s.close()
"""


def test_simulated_link_carries_its_rate_both_ways_at_once() -> None:
    bits = rate_bits(RATE)
    nbytes = int(bits / 8 * SECONDS)
    with simulated_hosts(2, rate=RATE, subnet="10.79.0") as (a, b):
        receivers = [
            subprocess.Popen(h.exec([sys.executable, "-c", _RECEIVE, h.address, str(PORT)]),
                             stdout=subprocess.PIPE, text=True)
            for h in (a, b)]
        for r in receivers:
            assert r.stdout is not None and r.stdout.readline().strip() == "listening"
        senders = [
            subprocess.Popen(src.exec([sys.executable, "-c", _SEND, dst.address, str(PORT),
                                       str(nbytes)]))
            for src, dst in ((a, b), (b, a))]
        assert [s.wait(timeout=30) for s in senders] == [0, 0]
        outs = [r.communicate(timeout=30)[0] for r in receivers]
        assert [r.returncode for r in receivers] == [0, 0]
    for direction, out in zip(("a->b", "b->a"), outs, strict=True):
        got = json.loads(out.strip().splitlines()[-1])
        measured = got["bytes"] * 8 / got["seconds"]
        print(f"{direction}: {measured / 1e6:.1f} Mbit/s of payload on a {RATE} link")  # with -s
        assert got["seconds"] > 0.5 * SECONDS, (direction, got)
        assert abs(measured / bits - 1) <= 0.15, (
            f"{direction}: measured {measured / 1e6:.1f} Mbit/s on a {RATE} link ({got})")
