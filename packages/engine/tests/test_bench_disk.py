"""`capstan bench-disk`: measured rates, the step-time bounds derived from them, and clean errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from capstan.engine import cli
from capstan.engine.machine.disk_bench import STATE_BYTES_PER_PARAM, DiskBenchError, offload_floor, parse_count


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli.main(["bench-disk", *argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_report_rates_and_bounds_follow_from_them(tmp_path, capsys):
    code, out, err = _run(capsys, str(tmp_path), "--size-mib", "16", "--block-mib", "2", "--inflight", "4",
                          "--rounds", "2", "--params", "350M", "--json")
    assert code == 0, err
    report = json.loads(out)
    assert report["size_bytes"] == 16 << 20 and report["block_bytes"] == 2 << 20 and report["rounds"] == 2
    for key in ("write_gbs", "read_gbs", "ram_copy_gbs", "adam_params_per_s"):
        assert report[key] > 0, key
    floor = report["floor"]
    n = 350_000_000
    assert floor["params"] == n and floor["disk_bytes_per_step"] == 2 * STATE_BYTES_PER_PARAM * n
    assert floor["disk_read_s"] == pytest.approx(STATE_BYTES_PER_PARAM * n / (report["read_gbs"] * 1e9))
    assert floor["disk_write_s"] == pytest.approx(STATE_BYTES_PER_PARAM * n / (report["write_gbs"] * 1e9))
    assert floor["adam_s"] == pytest.approx(n / report["adam_params_per_s"])
    assert floor["step_floor_s"] == max(floor["disk_s"], floor["adam_s"])
    assert list(tmp_path.iterdir()) == []  # the benchmark's file is gone


def test_text_report_names_the_directory_and_the_bound(tmp_path, capsys):
    code, out, err = _run(capsys, str(tmp_path), "--size-mib", "8", "--params", "7B")
    assert code == 0, err
    assert str(tmp_path) in out and "GB/s" in out and "per step" in out
    assert "bound by disk" in out or "bound by cpu adam" in out


def test_floor_picks_the_slower_of_disk_and_adam():
    rates = {"read_gbs": 2.0, "write_gbs": 1.0, "adam_params_per_s": 1e9}
    f = offload_floor(10**9, rates)
    assert f["disk_s"] == pytest.approx(12 / 2 + 12 / 1) and f["adam_s"] == pytest.approx(1.0)
    assert f["bound_by"] == "disk" and f["step_floor_s"] == f["disk_s"]
    fast_disk = offload_floor(10**9, {"read_gbs": 100.0, "write_gbs": 100.0, "adam_params_per_s": 1e8})
    assert fast_disk["bound_by"] == "cpu adam" and fast_disk["step_floor_s"] == pytest.approx(10.0)


@pytest.mark.parametrize("text, count", [("1000", 1000), ("350M", 350_000_000), ("7B", 7 * 10**9),
                                         ("1.5k", 1500), ("2g", 2 * 10**9), ("1_000", 1000)])
def test_parse_count(text, count):
    assert parse_count(text) == count


@pytest.mark.parametrize("text", ["7X", "", "B", "-3", "0.5"])
def test_parse_count_rejects(text):
    with pytest.raises(DiskBenchError, match="--params"):
        parse_count(text)


@pytest.mark.parametrize("args, message", [
    (["{missing}"], "is not a directory (it does not exist)"),
    (["{file}"], "is not a directory"),
    (["{dir}", "--size-mib", "3", "--block-mib", "2"], "--size-mib (3 MiB) must be a positive multiple"),
    (["{dir}", "--block-mib", "0"], "--block-mib gives 0 bytes"),
    (["{dir}", "--inflight", "0"], "--inflight must be at least 1"),
    (["{dir}", "--rounds", "0"], "--rounds must be at least 1"),
    (["{dir}", "--params", "lots"], "--params 'lots'"),
])
def test_bad_arguments_are_one_line_and_exit_2(tmp_path, capsys, args, message):
    (tmp_path / "a-file").write_text("x")
    paths = {"missing": tmp_path / "nope", "file": tmp_path / "a-file", "dir": tmp_path}
    code, out, err = _run(capsys, *[a.format(**paths) for a in args])
    assert code == cli.EXIT_BAD_INPUT and out == ""
    assert err.count("\n") == 1 and err.startswith("capstan: error: ") and message in err, err


FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    from capstan.engine import cli
    # Writing past RLIMIT_FSIZE fails with EFBIG where a full disk fails with ENOSPC; ignore SIGXFSZ
    # so the write returns the error.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (4 << 20, 4 << 20))
    sys.exit(cli.main(["bench-disk", sys.argv[1], "--size-mib", "16", "--block-mib", "1"]))
""")


def test_a_full_disk_is_a_clean_error_and_leaves_no_file(tmp_path):
    proc = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == cli.EXIT_BAD_INPUT, proc.stdout + proc.stderr
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("capstan: error: bench-disk: ") and str(tmp_path) in err[0], err
    assert f"at offset {4 << 20} failed" in err[0], err  # the first write past the limit, not a later one
    assert list(tmp_path.iterdir()) == []
