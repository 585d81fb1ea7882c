"""ActivationOffload alone: tensors leave (storage emptied), come back with their values in any order,
of any size in one O_DIRECT file, and the counts say what was away. The engine's use of it (identical
losses, lower RSS) is in packages/engine/tests/test_activation_offload.py."""

from __future__ import annotations

from pathlib import Path

import torch

from capstan.chunkmem import ActivationOffload


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
