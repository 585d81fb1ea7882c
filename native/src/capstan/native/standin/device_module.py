"""``torch.standin``: the per-device module torch and capstan look up with
``torch.get_device_module("standin")``, with the names ``torch.cuda`` has for
the calls device code makes (device selection, synchronization, memory
statistics, random state). Memory statistics come from torch.accelerator,
which reads the stand-in's device allocator.
"""

from __future__ import annotations

import torch

_NAME = "standin"


def is_available() -> bool:
    return True


# Like CUDA, the stand-in's memory statistics exist only once the device is initialized: torch.cuda's
# `reset_peak_memory_stats` raises "Invalid device argument" before the first CUDA tensor, `init()` or a
# call that initializes lazily (synchronize, current_stream, ...), which the GPU battery found in its first
# lease. The stand-in counts as initialized once it has allocated or one of those calls ran.
_initialized = False


def init() -> None:
    global _initialized
    _initialized = True


def is_initialized() -> bool:
    global _initialized
    if not _initialized and any(torch.accelerator.memory_stats(i).get("allocation.all.allocated", 0)
                                for i in range(device_count())):
        _initialized = True
    return _initialized


def _is_in_bad_fork() -> bool:
    return False


_count = None  # the library's device count, bound by standin.load() (`bind`): no import of the package


def bind(device_count_fn) -> None:  # noqa: ANN001
    """Called by standin.load(): how to ask the library for its device count."""
    global _count
    _count = device_count_fn


def device_count() -> int:
    # torch.accelerator.device_count() asks this module: ask the library
    assert _count is not None, "standin.load() first"
    return _count()


def current_device() -> int:
    return torch.accelerator.current_device_index()


def set_device(device: int | str | torch.device) -> None:
    torch.accelerator.set_device_index(device)


class device:
    """``with torch.standin.device(i):`` makes device i current inside, as ``torch.cuda.device`` does
    (activation checkpointing stashes each device's random state under it once the device is initialized)."""

    def __init__(self, device: int | str | torch.device | None) -> None:
        self.index = -1 if device is None else _index(device)
        self.previous = -1

    def __enter__(self) -> None:
        self.previous = current_device()
        if self.index >= 0 and self.index != self.previous:
            set_device(self.index)

    def __exit__(self, *exc) -> None:
        if self.index >= 0 and self.index != self.previous:
            set_device(self.previous)


def synchronize(device: int | str | torch.device | None = None) -> None:
    init()
    torch.accelerator.synchronize(device)


def current_stream(device: int | str | torch.device | None = None) -> torch.Stream:
    init()
    return torch.accelerator.current_stream(device)


def _index(device) -> int:
    if device is None:
        return current_device()
    if isinstance(device, int):
        return device
    d = torch.device(device)
    return current_device() if d.index is None else d.index


def memory_allocated(device=None) -> int:
    return torch.accelerator.memory_allocated(_index(device))


def max_memory_allocated(device=None) -> int:
    return torch.accelerator.max_memory_allocated(_index(device))


def memory_reserved(device=None) -> int:
    return torch.accelerator.memory_reserved(_index(device))


def max_memory_reserved(device=None) -> int:
    return torch.accelerator.max_memory_reserved(_index(device))


def reset_peak_memory_stats(device=None) -> None:
    if not is_initialized():  # what torch.cuda raises there (see `init`)
        raise RuntimeError("Invalid device argument : did you call init? (standin: the device is not initialized "
                           "yet; allocate on it or call torch.standin.init() first, as CUDA needs)")
    torch.accelerator.reset_peak_memory_stats(_index(device))


def memory_stats(device=None) -> dict:
    return torch.accelerator.memory_stats(_index(device))


def memory_stats_as_nested_dict(device=None) -> dict:
    """The allocator's statistics as torch.cuda's function of this name gives them: nested, not flattened
    (the flattening, in Python, is most of what a `max_memory_reserved` costs: 104 us against 14)."""
    return torch._C._accelerator_getDeviceStats(_index(device))


def mem_get_info(device=None) -> tuple[int, int]:
    return torch.accelerator.get_memory_info(_index(device))


def empty_cache() -> None:
    torch.accelerator.empty_cache()


# Random numbers: the stand-in draws from the CPU generator (see standin.cc's hooks), so its state is
# the CPU's and seeding the CPU seeds it.
def manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    manual_seed(seed)


def seed() -> None:
    pass


def seed_all() -> None:
    pass


def initial_seed() -> int:
    return torch.initial_seed()


def get_rng_state(device=None) -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device=None) -> None:
    torch.set_rng_state(state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [get_rng_state(i) for i in range(device_count())]


def set_rng_state_all(states) -> None:
    for s in states:
        set_rng_state(s)


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.float16, torch.bfloat16]


def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True
