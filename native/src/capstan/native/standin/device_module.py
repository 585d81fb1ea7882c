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


def is_initialized() -> bool:
    return True


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    from . import _device_count  # torch.accelerator.device_count() asks this module: ask the library

    return _device_count()


def current_device() -> int:
    return torch.accelerator.current_device_index()


def set_device(device: int | str | torch.device) -> None:
    torch.accelerator.set_device_index(device)


def synchronize(device: int | str | torch.device | None = None) -> None:
    torch.accelerator.synchronize(device)


def current_stream(device: int | str | torch.device | None = None) -> torch.Stream:
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
    torch.accelerator.reset_peak_memory_stats(_index(device))


def memory_stats(device=None) -> dict:
    return torch.accelerator.memory_stats(_index(device))


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
