"""A GPT whose embedding and head are slivers of a chunk: the list's ends go to a side list
(chunkmem's layout.split_list_ends), and the run trains the same trajectory as the flat buffer.

The reference GPT at d 512, vocabulary 256: chunks of its largest tensor (1M elements, an MLP weight)
hold each block in exactly three, but the 131K-element embedding ahead of the first block and the
head after the last each take a chunk of their own. With the ends aside the decayed list has no
padding at all; the side list steps with that list's hyper-parameters (weight decay) and counts in the
gradient norm as it does, so clipping, decay and every update are those of the flat run.
"""

from __future__ import annotations

import pytest

from capstan.engine.testing import assert_trajectories_close, tiny_gpt_config, trajectory

STEPS = 20
MODEL = {"n_layers": 2, "n_heads": 4, "d_model": 512, "seq_len": 16}


def _cfg(memory: dict) -> dict:
    return tiny_gpt_config(STEPS, 1, model=MODEL, memory=memory)


def _lists(memory: dict) -> tuple[list[int], int, int]:
    """(list_group of the chunked model, elements of its chunks, parameters)."""
    from capstan.chunkmem import ChunkKind
    from capstan.engine import initialize

    engine = initialize(config=_cfg(memory))
    try:
        model = engine.module
        elements = sum(c.capacity for lst in model.chunks[ChunkKind.PARAM] for c in lst)
        params = sum(h.slot.numel for h in model.homes.values())
        return list(model.list_group), elements, params
    finally:
        engine.close()


@pytest.mark.parametrize("memory", [{"offload": "cpu"}, {"offload": "disk", "cpu_budget": "48MiB"}],
                         ids=["cpu", "disk"])
def test_the_ends_of_a_chunk_list_go_aside_and_train_as_the_flat_buffer(memory: dict, tmp_path) -> None:
    memory = {**memory, "disk_dir": str(tmp_path)} if memory["offload"] == "disk" else memory
    groups, elements, params = _lists(memory)
    assert len(groups) == len(set(groups)) + 1 and groups[-1] == groups[0]  # the decayed list's side list
    assert elements - params < 2048 * len(groups)  # no padding but each list's rounding to 2048 elements
    flat = trajectory(_cfg({}), STEPS)
    chunked = trajectory(_cfg(memory), STEPS)
    assert_trajectories_close(chunked["loss"], flat["loss"])
    assert_trajectories_close(chunked["norm"], flat["norm"])
    assert max(flat["norm"]) > 0.5  # tiny_gpt_config clips at 0.5: the side list's norm term counts
