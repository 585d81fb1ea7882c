"""Two "hosts" on one machine: network namespaces on one switch (capstan.comm.testing.netns; root only).

Namespace A holds 10.77.0.1, namespace B 10.77.0.2 (a /24; each host's interface is named `cveth`
inside its namespace, so one GLOO_SOCKET_IFNAME serves every rank; lo up in each).
Four ranks, two per namespace, train the tiny reference GPT in fp32 with tp=2 inside each "host" and
dp=2 across; the losses must match a one-process run of the same global batch (grad_accum_steps=2).

* test_two_namespaces_tp2_dp2_match_one_process starts the ranks torchrun-style (RANK, WORLD_SIZE,
  LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) with `ip netns exec`.
* test_capstan_launch_hostfile_across_namespaces runs `capstan launch --hostfile` inside namespace A
  (hostfile `10.77.0.1 slots=2`, `10.77.0.2 slots=2`); Open MPI starts its daemon on 10.77.0.2
  through an ssh-like agent script that does `ip netns exec B sh -c "<command>"` (PRRTE's
  plm_ssh_agent), with PRRTE's and the TCP BTL's traffic pinned to `cveth` (docs/launch.md).
* test_onebit_adam_across_a_100_mbit_link does the same over links limited to 100 Mbit/s by tc
  (the slow cluster of tools/bench_slow_network.py), training with 1-bit Adam past its freeze:
  every step reports the bytes it sent (none before the freeze, the formula's after), and the
  losses stay within 10% of the one-process run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from capstan.comm.testing import clean_env, mpirun_flavor, requires_mpirun
from capstan.comm.testing.netns import IFNAME, netns_reason, shaping, simulated_hosts

REPO = Path(__file__).resolve().parents[1]
TINY = str(REPO / "examples" / "tiny.toml")
CLI = [sys.executable, "-m", "capstan.engine.cli"]
STEPS = 10
ADDR = ["10.77.0.1", "10.77.0.2"]

_REASON = netns_reason()
pytestmark = pytest.mark.skipif(_REASON is not None, reason=_REASON or "")


@contextlib.contextmanager
def _two_hosts(rate: str | None = None) -> Iterator[list[str]]:
    """Namespaces [A, B] holding ADDR, on one switch (links limited to `rate`); everything started in
    them is killed and they are deleted on the way out."""
    with simulated_hosts(2, rate=rate) as hosts:
        assert [h.address for h in hosts] == ADDR
        yield [h.namespace for h in hosts]


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
                         text=True, timeout=120, env=clean_env())
    assert one.returncode == 0, one.stderr[-3000:]
    return _losses(single)


def test_two_namespaces_tp2_dp2_match_one_process(tmp_path: Path) -> None:
    procs: list[subprocess.Popen] = []
    with _two_hosts() as ns:
        try:
            multi = tmp_path / "multi"
            for rank in range(4):
                host = rank // 2  # tp=2 fastest: ranks 0,1 (one tp group) on A, ranks 2,3 on B
                env = clean_env({"RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
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


def _launch_across(tmp_path: Path, ns: list[str], run_dir: Path, *extra: str) -> str:
    """`capstan launch --hostfile` inside namespace A, two ranks per "host" (tp = 2 in each, dp = 2
    across); returns its output after asserting that it succeeded through the agent."""
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
    # MASTER_ADDR/MASTER_PORT: the namespaces share one hostname, so without them rank 0 would
    # take the world for one host and advertise 127.0.0.1.
    env = clean_env({"MASTER_ADDR": ADDR[0], "MASTER_PORT": "29512", "GLOO_SOCKET_IFNAME": IFNAME,
                      "CAPSTAN_COMM_TIMEOUT": "60", "CAPSTAN_COMM_BACKEND": "gloo"})
    cmd = ["ip", "netns", "exec", ns[0], *CLI, "launch", "-np", "4", "--hostfile", str(hostfile),
           *[f"--mpirun-arg={x}" for x in mpirun_opts], "--", "capstan",
           *_train(run_dir, "--set", "parallel.tp=2", *extra)]
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
    return out


@requires_mpirun()
@pytest.mark.skipif(mpirun_flavor() != "openmpi", reason="the remote agent options are Open MPI's (PRRTE)")
def test_capstan_launch_hostfile_across_namespaces(tmp_path: Path) -> None:
    with _two_hosts() as ns:
        multi = tmp_path / "multi"
        _launch_across(tmp_path, ns, multi)
        a, b = _one_process(tmp_path), _losses(multi)
        assert len(a) == len(b) == STEPS
        assert b == pytest.approx(a, rel=1e-5), (a, b)


@requires_mpirun()
@pytest.mark.skipif(mpirun_flavor() != "openmpi", reason="the remote agent options are Open MPI's (PRRTE)")
@pytest.mark.skipif(shaping() is None, reason="tc cannot shape links here (neither netem nor tbf)")
def test_onebit_adam_across_a_100_mbit_link(tmp_path: Path) -> None:
    freeze = 3
    with _two_hosts(rate="100mbit") as ns:
        multi = tmp_path / "multi"
        _launch_across(tmp_path, ns, multi, "--set", "parallel.compression=\"onebit\"",
                       "--set", f"parallel.compression_freeze_steps={freeze}")
    records = [json.loads(x) for x in (multi / "metrics.jsonl").read_text().splitlines()]
    wire = [r["comm.wire_bytes"] for r in records]
    assert wire[:freeze] == [0] * freeze and len(set(wire[freeze:])) == 1 and wire[-1] > 0, wire
    a, b = _one_process(tmp_path), [r["loss"] for r in records]
    assert b[:freeze] == pytest.approx(a[:freeze], rel=1e-5)  # exact AdamW until the freeze
    assert b != pytest.approx(a, rel=1e-5) and b == pytest.approx(a, rel=1e-1), (a, b)
