"""Facts about the GPU that launch heuristics need, queried once per device."""

from functools import cache

import torch


@cache
def compute_capability(device: torch.device) -> tuple[int, int]:
    """The (major, minor) compute capability of CUDA ``device``: 9 is Hopper."""
    return torch.cuda.get_device_capability(device)


@cache
def num_sms(device: torch.device) -> int:
    """The number of streaming multiprocessors of CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count
