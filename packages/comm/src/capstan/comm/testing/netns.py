"""Simulated hosts on one machine: network namespaces on one switch, links shaped with tc (root only).

    with simulated_hosts(4, rate="100mbit", delay_ms=1.0) as hosts:
        for rank, host in enumerate(hosts):
            subprocess.Popen(host.exec(["capstan", "train", ...]), env={..., "GLOO_SOCKET_IFNAME": IFNAME})

Each host is a namespace whose only interfaces are `lo` and ``IFNAME`` (the same name in every
namespace, so one GLOO_SOCKET_IFNAME serves every rank), holding ``<subnet>.<i + 1>/24``. Its other
end sits in a switch namespace on a bridge. With `rate`, both directions of every host's link are
limited (the host end's egress and the switch end's egress: a NIC of that speed, full duplex), with
netem where the kernel has it (which also adds `delay_ms` each way) and a token bucket (tbf) where it
does not (no added delay: `shaping()` says which). Every process left in the namespaces is killed and
everything is deleted on the way out.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

__all__ = ["Host", "simulated_hosts", "netns_reason", "shaping", "IFNAME", "rate_bits"]

IFNAME = "cveth"


@dataclass(frozen=True)
class Host:
    namespace: str
    address: str

    def exec(self, argv: Sequence[str]) -> list[str]:
        """`argv` run inside this host's namespace."""
        return ["ip", "netns", "exec", self.namespace, *argv]


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _try(argv: Sequence[str]) -> bool:
    return subprocess.run(list(argv), capture_output=True).returncode == 0


def netns_reason() -> str | None:
    """Why namespaces cannot be made here (None: they can)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root to create network namespaces"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    probe = f"cpprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def shaping() -> str | None:
    """How links are shaped here: "netem" (rate and delay), "tbf" (rate only) or None (no tc)."""
    if netns_reason() is not None or shutil.which("tc") is None:
        return None
    tag = uuid.uuid4().hex[:6]
    ns, a, b = f"cpq{tag}", f"cqa{tag}", f"cqb{tag}"
    try:
        _ip("netns", "add", ns)
        _ip("link", "add", a, "type", "veth", "peer", "name", b)
        _ip("link", "set", a, "netns", ns)
        for kind in (["netem", "delay", "1ms", "rate", "100mbit"], ["tbf", "rate", "100mbit", "burst", "64kb",
                                                                      "latency", "100ms"]):
            if _try(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", a, "root", *kind]):
                return kind[0]
        return None
    except subprocess.CalledProcessError:
        return None
    finally:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", b], capture_output=True)


def rate_bits(rate: str) -> float:
    """Bits per second of a tc rate ("100mbit", "1gbit", "500kbit")."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: expected a number and kbit, mbit or gbit (e.g. 100mbit)")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _shape(namespace: str, dev: str, rate: str, delay_ms: float, kind: str) -> None:
    if kind == "netem":
        args = ["netem", "delay", f"{delay_ms}ms", "rate", rate, "limit", "100000"]
    else:  # a bucket of 4 ms of traffic (at least 64 KiB: a whole GSO packet), a queue of 200 ms
        burst = max(64 * 1024, int(rate_bits(rate) / 8 * 0.004))
        args = ["tbf", "rate", rate, "burst", str(burst), "latency", "200ms"]
    _ip("netns", "exec", namespace, "tc", "qdisc", "replace", "dev", dev, "root", *args)


@contextlib.contextmanager
def simulated_hosts(n: int, rate: str | None = None, delay_ms: float = 0.0,
                    subnet: str = "10.77.0") -> Iterator[list[Host]]:
    """`n` hosts on one switch (see the module docstring); rate: each link's speed in tc's words."""
    if n < 1 or n > 250:
        raise ValueError(f"simulated_hosts needs 1..250 hosts, got {n}")
    kind = shaping() if rate is not None else None
    if rate is not None and kind is None:
        raise RuntimeError("simulated_hosts: rate given, but tc cannot shape links here (no netem or tbf)")
    tag = uuid.uuid4().hex[:6]
    switch = f"cps{tag}"
    hosts = [Host(f"cph{i}{tag}", f"{subnet}.{i + 1}") for i in range(n)]
    made: list[str] = []
    try:
        _ip("netns", "add", switch)
        made.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, host in enumerate(hosts):
            _ip("netns", "add", host.namespace)
            made.append(host.namespace)
            near, far = f"cvh{i}{tag}", f"cvs{i}{tag}"
            _ip("link", "add", near, "type", "veth", "peer", "name", far)
            _ip("link", "set", near, "netns", host.namespace)
            _ip("link", "set", far, "netns", switch)
            _ip("-n", host.namespace, "link", "set", near, "name", IFNAME)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", IFNAME)
            _ip("-n", host.namespace, "link", "set", IFNAME, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
            _ip("-n", switch, "link", "set", far, "master", "br0")
            _ip("-n", switch, "link", "set", far, "up")
            if rate is not None and kind is not None:
                _shape(host.namespace, IFNAME, rate, delay_ms, kind)  # what the host sends
                _shape(switch, far, rate, delay_ms, kind)  # what it receives
        yield hosts
    finally:
        for ns in made:
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split()
            for pid in pids:  # only processes started in these namespaces
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # deletes its veth ends
