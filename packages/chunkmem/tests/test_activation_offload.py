"""ActivationOffload alone: tensors leave (storage emptied), come back with their values in any order,
of any size in one O_DIRECT file, and the counts say what was away. The engine's use of it (identical
losses, lower RSS) is in packages/engine/tests/test_activation_offload.py."""

from __future__ import annotations

import contextlib
from pathlib import Path

import pytest
import torch

from capstan.chunkmem import ActivationOffload
from capstan.native import standin


def test_tensors_of_any_size_leave_and_come_back(tmp_path: Path) -> None:
    keeper = ActivationOffload.to_disk(tmp_path, rank=0)
    g = torch.Generator().manual_seed(0)
    # the first is a whole number of 4 KiB blocks (the file opens for O_DIRECT), the others are not
    tensors = [torch.randn(1024, generator=g), torch.randn(250, generator=g), torch.randn(3, 500, generator=g)]
    want = [t.clone() for t in tensors]
    entries = [keeper.offload(t) for t in tensors]
    assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
    stats = keeper.stats()
    assert stats["offloaded_bytes"] == stats["offloaded_peak_bytes"] == sum(w.nbytes for w in want)
    for entry in (entries[2], entries[0], entries[1]):  # backward's order, and then some
        keeper.restore(entry)
    assert all(torch.equal(t, w) for t, w in zip(tensors, want))
    assert keeper.stats()["offloaded_bytes"] == 0
    keeper.restore(entries[0])  # a second restore changes nothing
    assert torch.equal(tensors[0], want[0])
    again = keeper.offload(tensors[1])  # slots are reused
    keeper.restore(again)
    assert torch.equal(tensors[1], want[1])
    keeper.close()
    assert not list(tmp_path.glob("*.bin"))


def test_counting_moves_nothing_and_a_view_stays() -> None:
    keeper = ActivationOffload.counting()
    x = torch.ones(100)
    entry = keeper.offload(x)
    assert x.untyped_storage().nbytes() == 400 and keeper.stats()["held_peak_bytes"] == 400
    keeper.restore(entry)
    assert keeper.stats()["held_bytes"] == 0


def test_a_tensor_dropped_before_its_restore_gives_its_bytes_back(tmp_path: Path) -> None:
    keeper = ActivationOffload.to_disk(tmp_path)
    x = torch.ones(2048)
    keeper.offload(x)
    assert keeper.stats()["offloaded_bytes"] == 8192
    del x  # an aborted step: the graph and its tensors go without a backward
    assert keeper.stats()["offloaded_bytes"] == 0
    keeper.close()


@pytest.mark.parametrize("lag", [0, 3])
@standin.requires()
def test_a_devices_tensors_leave_for_pinned_ram_and_come_back(lag: int) -> None:
    """to_host on an accelerator (the stand-in, not the CPU): each tensor's storage empties on the device,
    its values wait in pinned RAM, and they come back in backward's order, restoring one starting the copy
    back of the one offloaded before it, straight into the tensor's storage (no second buffer on the
    device), with the same values; a dropped tensor gives its bytes back; the pinned buffers are reused.
    lag: copies not yet done when the host asks, as on a GPU."""
    device = torch.device(standin.load(), 0)
    keeper = ActivationOffload.to_host(device)
    g = torch.Generator().manual_seed(1)
    with standin.late_events(lag) if lag else contextlib.nullcontext():
        for _ in range(2):  # the second round reuses the first's pinned buffers
            want = [torch.randn(n, generator=g) for n in (1024, 4096, 4096, 300)]
            tensors = [w.to(device) for w in want]
            entries = [keeper.offload(t) for t in tensors]
            assert all(t.untyped_storage().nbytes() == 0 for t in tensors)
            assert all(e.host is not None and e.host.is_pinned() for e in entries)
            keeper.restore(entries[3])  # starts the copy back of entries[2], into its own storage
            assert entries[2].read is not None and tensors[2].untyped_storage().nbytes() == tensors[2].nbytes
            assert entries[1].read is None and tensors[1].untyped_storage().nbytes() == 0
            for e in (entries[2], entries[1], entries[0]):
                keeper.restore(e)
            assert all(torch.equal(t.cpu(), w) for t, w in zip(tensors, want, strict=True))
            assert keeper.stats()["offloaded_bytes"] == 0
        pinned = sum(len(v) for v in keeper._pinned.values()) + len(keeper._pinned_busy)
        assert pinned <= 4 or lag, pinned  # one per tensor of a round, reused by the next (once seen done)
        x = torch.ones(2048, device=device)
        keeper.offload(x)
        del x  # an aborted step
        assert keeper.stats()["offloaded_bytes"] == 0
    keeper.close()
