"""The /proc memory readers (capstan.comm.health.procmem)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from capstan.comm.health.procmem import mem_available_bytes, peak_rss_bytes, proc_kib, rss_bytes


def test_a_missing_file_or_key_reads_as_zero(tmp_path: Path) -> None:
    status = tmp_path / "status"
    status.write_text("Name:\tpython\nVmHWM:\t  2048 kB\nVmBad:\tx kB\n")
    assert proc_kib(str(status), "VmHWM") == 2048 * 1024
    assert proc_kib(str(status), "VmRSS") == 0
    assert proc_kib(str(status), "VmBad") == 0
    assert proc_kib(str(tmp_path / "absent"), "VmHWM") == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux /proc")
def test_this_process_and_machine() -> None:
    before = rss_bytes()
    block = bytearray(64 << 20)  # touched: resident
    block[:: 4096] = b"\x01" * len(block[:: 4096])
    now, peak = rss_bytes(), peak_rss_bytes()
    assert now - before >= 32 << 20  # most of the 64 MiB; the allocator may reuse some freed pages
    assert peak >= now > 0
    assert mem_available_bytes() > 0
    del block
