"""Facts about the GPU that launch heuristics need, queried once per device."""

from functools import cache

import torch


@cache
def num_sms(device: torch.device) -> int:
    """The number of streaming multiprocessors of CUDA ``device``."""
    return torch.cuda.get_device_properties(device).multi_processor_count
