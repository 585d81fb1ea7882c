"""Two "hosts" on one machine: network namespaces joined by a veth pair (root only).

Namespace A holds 10.77.0.1, namespace B 10.77.0.2 (a /24 on the veth pair, whose two ends are both
named `cveth` inside their namespaces, so one GLOO_SOCKET_IFNAME serves every rank; lo up in each).
Four ranks, two per namespace, train the tiny reference GPT in fp32 with tp=2 inside each "host" and
dp=2 across; the losses must match a one-process run of the same global batch (grad_accum_steps=2).

* test_two_namespaces_tp2_dp2_match_one_process starts the ranks torchrun-style (RANK, WORLD_SIZE,
  LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with `ip netns exec`.
* test_capstan_launch_hostfile_across_namespaces runs `capstan launch --hostfile` inside namespace A
  (hostfile `10.77.0.1 slots=2`, `10.77.0.2 slots=2`); Open MPI starts its daemon on 10.77.0.2
  through an ssh-like agent script that does `ip netns exec B sh -c "<command>"` (PRRTE's
  plm_ssh_agent), with PRRTE's and the TCP BTL's traffic pinned to `cveth` (docs/launch.md).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from capstan.comm.testing import mpirun_flavor, requires_mpirun
from capstan.comm.testing.harness import _clean_env

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "tiny.toml")
CLI = [sys.executable, "-m", "capstan.engine.cli"]
STEPS = 10
ADDR = ["10.77.0.1", "10.77.0.2"]
IFNAME = "cveth"  # both ends of the veth pair, each inside its own namespace


def _netns_reason() -> str | None:
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


_REASON = _netns_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def _two_hosts() -> Iterator[list[str]]:
    """Namespaces [A, B] (unique names) joined by a veth pair; every process left in them is killed
    and both are deleted on the way out."""
    tag = uuid.uuid4().hex[:6]
    ns = [f"cpa{tag}", f"cpb{tag}"]
    veth = [f"cva{tag}", f"cvb{tag}"]
    try:
        for n in ns:
            _ip("netns", "add", n)
        _ip("link", "add", veth[0], "type", "veth", "peer", "name", veth[1])
        for n, v, a in zip(ns, veth, ADDR):
            _ip("link", "set", v, "netns", n)
            _ip("-n", n, "link", "set", v, "name", IFNAME)
            _ip("-n", n, "addr", "add", f"{a}/24", "dev", IFNAME)
            _ip("-n", n, "link", "set", IFNAME, "up")
            _ip("-n", n, "link", "set", "lo", "up")
        yield ns
    finally:
        for n in ns:
            pids = subprocess.run(["ip", "netns", "pids", n], capture_output=True, text=True).stdout.split()
            for pid in pids:  # only processes this test started live in its namespaces
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), 9)
        for n in ns:
            subprocess.run(["ip", "netns", "del", n], capture_output=True)  # deletes its end of the veth pair
        subprocess.run(["ip", "link", "del", veth[0]], capture_output=True)  # in case it never moved


def _train(run_dir: Path, *extra: str) -> list[str]:
    return ["train", "--config", TINY, "--set", f"train.steps={STEPS}", "--set", "train.warmup_steps=2",
            "--set", "train.eval_every=0", "--set", "model.n_layers=1", "--set", "data.max_bytes=200000",
            "--set", "precision.dtype=\"fp32\"", "--set", "log.every=5",
            "--set", f"log.run_dir=\"{run_dir}\"", *extra]


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _one_process(tmp_path: Path) -> list[float]:
    single = tmp_path / "single"
    one = subprocess.run(CLI + _train(single, "--set", "train.grad_accum_steps=2"), capture_output=True,
                         text=True, timeout=120, env=_clean_env(None))
    assert one.returncode == 0, one.stderr[-3000:]
    return _losses(single)


def test_two_namespaces_tp2_dp2_match_one_process(tmp_path: Path) -> None:
    procs: list[subprocess.Popen] = []
    with _two_hosts() as ns:
        try:
            multi = tmp_path / "multi"
            for rank in range(4):
                host = rank // 2  # tp=2 fastest: ranks 0,1 (one tp group) on A, ranks 2,3 on B
                env = _clean_env({"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
                                  "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": ADDR[0], "MASTER_PORT": "29511",
                                  "GLOO_SOCKET_IFNAME": IFNAME, "CAPSTAN_COMM_TIMEOUT": "60",
                                  "CAPSTAN_COMM_BACKEND": "gloo"})
                log = open(tmp_path / f"rank{rank}.log", "w")
                procs.append(subprocess.Popen(["ip", "netns", "exec", ns[host], *CLI,
                                               *_train(multi, "--set", "parallel.tp=2")],
                                              stdout=log, stderr=subprocess.STDOUT, env=env))
                log.close()
            a = _one_process(tmp_path)
            codes = [p.wait(timeout=180) for p in procs]
            logs = {r: (tmp_path / f"rank{r}.log").read_text() for r in range(4)}
            assert codes == [0] * 4, "\n".join(f"--- rank {r} (exit {c})\n{logs[r][-2000:]}"
                                               for r, c in enumerate(codes))
            assert "world 4 = dp 2 x tp 2 x pp 1" in logs[0]
            b = _losses(multi)
            assert len(a) == len(b) == STEPS
            # fp32: tp splits the matmuls and dp sums the gradients in another order, so the sums round
            # differently; 1e-5 relative is a few hundred ulps after 10 steps of Adam.
            assert b == pytest.approx(a, rel=1e-5), (a, b)
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()


# ssh-like remote agent for Open MPI: called as `agent [options] host command...`, it runs the
# command (PRRTE's daemon start line, a shell string) in the namespace that holds that address.
AGENT = """#!/bin/sh
echo "$*" >> "$0.log"
while [ $# -gt 0 ]; do case "$1" in -*) shift;; *) break;; esac; done
host=$1; shift
case "$host" in
  {a}) ns={na};;
  {b}) ns={nb};;
  *) echo "$0: unknown host $host" >&2; exit 255;;
esac
exec ip netns exec "$ns" sh -c "$*"
"""


@requires_mpirun()
@pytest.mark.skipif(mpirun_flavor() != "openmpi", reason="the remote agent options are Open MPI's (PRRTE)")
def test_capstan_launch_hostfile_across_namespaces(tmp_path: Path) -> None:
    with _two_hosts() as ns:
        agent = tmp_path / "agent.sh"
        agent.write_text(AGENT.format(a=ADDR[0], na=ns[0], b=ADDR[1], nb=ns[1]))
        agent.chmod(0o755)
        hostfile = tmp_path / "hosts"
        hostfile.write_text(f"{ADDR[0]} slots=2\n{ADDR[1]} slots=2\n")
        # Only the agent is strictly needed (lo and cveth are the only interfaces in each namespace);
        # the two if_include options pin PRRTE's out-of-band and MPI's TCP traffic to cveth, as on
        # hosts with several interfaces.
        mpirun_opts = ["--prtemca", "plm_ssh_agent", str(agent),  # daemons on other "hosts" via the agent
                       "--prtemca", "prte_if_include", IFNAME,
                       "--mca", "btl_tcp_if_include", IFNAME]
        multi = tmp_path / "multi"
        # MASTER_ADDR/MASTER_PORT: the namespaces share one hostname, so without them rank 0 would
        # take the world for one host and advertise 127.0.0.1.
        env = _clean_env({"MASTER_ADDR": ADDR[0], "MASTER_PORT": "29512", "GLOO_SOCKET_IFNAME": IFNAME,
                          "CAPSTAN_COMM_TIMEOUT": "60", "CAPSTAN_COMM_BACKEND": "gloo"})
        cmd = ["ip", "netns", "exec", ns[0], *CLI, "launch", "-np", "4", "--hostfile", str(hostfile),
               *[f"--mpirun-arg={x}" for x in mpirun_opts], "--", "capstan",
               *_train(multi, "--set", "parallel.tp=2")]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=80)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            out, _ = proc.communicate()
            raise AssertionError(f"capstan launch timed out:\n{out[-4000:]}") from None
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()
        assert proc.returncode == 0, out[-4000:]
        assert "world 4 = dp 2 x tp 2 x pp 1" in out
        assert ADDR[1] in (tmp_path / "agent.sh.log").read_text()  # the daemon on B came through the agent
        a, b = _one_process(tmp_path), _losses(multi)
        assert len(a) == len(b) == STEPS
        assert b == pytest.approx(a, rel=1e-5), (a, b)
