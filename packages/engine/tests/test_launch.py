"""`capstan launch` command construction: placement, hostfile parsing, env forwarding, errors (no processes)."""

from __future__ import annotations

from pathlib import Path

import pytest

from capstan.engine.cli import main
from capstan.engine.run.mpirun import (
    HostSlots,
    LaunchRequestError,
    build_command,
    describe_failure,
    forwarded_env,
    parse_hostfile,
    plan_hosts,
    tp_from_command,
)

REPO = Path(__file__).resolve().parents[3]
TINY = str(REPO / "examples" / "tiny.toml")
ENV = {"PATH": "/bin", "VIRTUAL_ENV": "/venv", "CAPSTAN_LOG_LEVEL": "DEBUG", "HOME": "/root",
       "CAPSTAN_RENDEZVOUS_FILE": "/tmp/x", "MASTER_ADDR": "10.0.0.1", "OMP_NUM_THREADS": "1"}


def _cmd(*args, **kw):
    kw.setdefault("mpirun", "/x/mpirun")
    kw.setdefault("openmpi", True)
    kw.setdefault("root", False)
    kw.setdefault("environ", ENV)
    return build_command(["capstan", "train", "--config", TINY, *args], **kw)


def test_parse_hostfile() -> None:
    text = "# cluster\nnode1 slots=4\nnode2 slots=2 max_slots=8  # comment\n\nnode3\nnode1 slots=2\n"
    assert parse_hostfile(text) == [HostSlots("node1", 6), HostSlots("node2", 2), HostSlots("node3", 1)]
    with pytest.raises(LaunchRequestError, match="line 1: cannot parse 'slots:4'"):
        parse_hostfile("node1 slots:4")
    with pytest.raises(LaunchRequestError, match="lists no hosts"):
        parse_hostfile("# nothing\n")
    with pytest.raises(LaunchRequestError, match="has 0 slots"):
        parse_hostfile("a slots=0")


def test_plan_keeps_tp_groups_on_one_host() -> None:
    hosts = [HostSlots("a", 4), HostSlots("b", 4), HostSlots("c", 4)]
    assert plan_hosts(hosts, 6, 2) == [HostSlots("a", 4), HostSlots("b", 2)]
    assert plan_hosts(hosts, 12, 4) == hosts
    with pytest.raises(LaunchRequestError, match="must be a multiple of tp 4.*but b has 6"):
        plan_hosts([HostSlots("a", 4), HostSlots("b", 6)], 8, 4)
    with pytest.raises(LaunchRequestError, match="offers only 12 slots"):
        plan_hosts(hosts, 16, 2)
    with pytest.raises(LaunchRequestError, match="-np 6 is not a multiple of tp 4"):
        plan_hosts(hosts, 6, 4)


def test_single_host_command() -> None:
    cmd = _cmd(np=4, tp=2)
    assert cmd[:4] == ["/x/mpirun", "-np", "4", "--oversubscribe"]
    assert "--allow-run-as-root" not in cmd and "--host" not in cmd
    assert "--allow-run-as-root" in _cmd(np=4, tp=2, root=True)
    # One host: no libfabric probe (1.1 s of each rank's MPI_Init), unless the user chose the btls.
    assert cmd[4:7] == ["--mca", "btl", "^ofi"]
    assert "^ofi" not in _cmd(np=4, tp=2, environ={**ENV, "OMPI_MCA_btl": "self,tcp"})
    chosen = _cmd(np=4, tp=2, mpirun_args=["--mca", "btl", "self,sm"])
    assert "^ofi" not in chosen and chosen.count("btl") == 1
    assert "^ofi" in _cmd(np=4, tp=2, mpirun_args=["--mca", "btl_tcp_if_include", "eth0"])
    i = cmd.index("-m")
    assert cmd[i - 1 : i + 3] == [cmd[i - 1], "-m", "capstan.engine.cli", "train"]


def test_env_forwarding() -> None:
    assert forwarded_env(ENV) == ["CAPSTAN_LOG_LEVEL", "MASTER_ADDR", "OMP_NUM_THREADS", "PATH", "VIRTUAL_ENV"]
    cmd = _cmd(np=2, tp=1, extra_env={"CAPSTAN_STATUS_DIR": "/s"})
    pairs = {cmd[i + 1] for i, a in enumerate(cmd) if a == "-x"}
    assert pairs == {"CAPSTAN_LOG_LEVEL", "CAPSTAN_STATUS_DIR", "MASTER_ADDR", "OMP_NUM_THREADS", "PATH",
                     "VIRTUAL_ENV"}
    mpich = _cmd(np=2, tp=1, openmpi=False)
    assert "-x" not in mpich and "--oversubscribe" not in mpich
    assert mpich[mpich.index("-envlist") + 1] == "CAPSTAN_LOG_LEVEL,MASTER_ADDR,OMP_NUM_THREADS,PATH,VIRTUAL_ENV"


def test_hostfile_command(tmp_path: Path) -> None:
    hf = tmp_path / "hosts"
    hf.write_text("n1 slots=2\nn2 slots=2\n")
    cmd = _cmd(np=4, hostfile=str(hf), tp=2, root=True)
    assert cmd[3:7] == ["--host", "n1:2,n2:2", "--map-by", "slot"]
    assert "--oversubscribe" not in cmd and "^ofi" not in cmd  # slots are what the hostfile says; a network
    hf.write_text("n1 slots=3\nn2 slots=3\n")
    with pytest.raises(LaunchRequestError, match="n1 has 3, n2 has 3"):
        _cmd(np=4, hostfile=str(hf), tp=2)
    with pytest.raises(LaunchRequestError, match="cannot read hostfile"):
        _cmd(np=4, hostfile=str(tmp_path / "missing"), tp=2)


def test_tp_from_the_wrapped_config() -> None:
    assert tp_from_command(["capstan", "train", "--config", TINY]) == 1
    assert tp_from_command(["capstan", "train", "--config", TINY, "--set", "parallel.tp=2"]) == 2
    assert tp_from_command(["capstan", "train", "--config=" + TINY, "--set=parallel.tp=4"]) == 4
    assert tp_from_command(["capstan", "train", "--config", "/missing.toml"]) == 1  # the ranks report it
    with pytest.raises(LaunchRequestError, match="-np 3 is not a multiple of tp 2"):
        _cmd("--set", "parallel.tp=2", np=3)


def test_describe_failure() -> None:
    st = {0: {"host": "h", "pid": 10, "code": None, "t": None}, 1: {"host": "h", "pid": 11, "code": None, "t": None},
          2: {"host": "h", "pid": 12, "code": 1, "t": 105.0}}
    line = describe_failure(st, 3, deaths={0: 106.0, 1: 100.0})
    assert line.startswith("rank 1 (pid 11 on h) died without an exit status") and "[0, 2]" in line
    st = {0: {"host": "h", "pid": 10, "code": 2, "t": 5.0}, 1: {"host": "h", "pid": 11, "code": 2, "t": 4.0}}
    assert describe_failure(st, 2).startswith("rank 1 failed first with exit code 2")
    assert describe_failure({}, 2) is None


def test_cli_dry_run_and_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["launch", "-np", "2", "--dry-run", "--", "capstan", "train", "--config", TINY]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and " -np 2 " in out and "capstan.engine.cli train --config" in out
    hf = tmp_path / "hosts"
    hf.write_text("a slots=3\n")
    assert main(["launch", "-np", "2", "--tp", "2", "--hostfile", str(hf), "--dry-run", "--", "capstan"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("capstan: error:") and "a has 3" in err
    assert main(["launch", "-np", "2", "--dry-run"]) == 2
    assert "nothing to launch" in capsys.readouterr().err


def test_max_restarts_requests(capsys: pytest.CaptureFixture[str]) -> None:
    from capstan.engine.cli.launch import _is_train, _restartable, resumed_command

    train = ["capstan", "train", "--config", TINY]
    assert _is_train(train) and _is_train(["/venv/bin/capstan", "train"]) and not _is_train(["echo", "train"])
    assert resumed_command(train)[-4:] == ["--set", "checkpoint.resume=true", "--set",
                                           "checkpoint.allow_fresh_start=true"]
    crashed = {0: {"code": None}, 1: {"code": 1}}
    assert _restartable(crashed, 137) and not _restartable({0: {"code": 2}, 1: {"code": None}}, 2)
    assert not _restartable({0: {"code": 0}}, 0)
    assert main(["launch", "-np", "2", "--max-restarts", "-1", "--", *train]) == 2
    assert "--max-restarts -1: must be >= 0" in capsys.readouterr().err
    assert main(["launch", "-np", "2", "--max-restarts", "1", "--", "echo", "hi"]) == 2
    assert "needs a `capstan train` command" in capsys.readouterr().err
    # the relaunched command, as mpirun would run it
    cmd = build_command(resumed_command(train), 2, mpirun="/x/mpirun", openmpi=True, root=False, environ=ENV)
    assert cmd[-4:] == ["--set", "checkpoint.resume=true", "--set", "checkpoint.allow_fresh_start=true"]
