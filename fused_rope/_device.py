"""Facts about the GPU that launch heuristics need, queried once per device.

The memo is a plain dict, not ``functools.cache``: ``torch.compile`` traces the dispatch rules
that read these facts, and Dynamo warns at every ``lru_cache``-wrapped call it traces through
(PyTorch 2.11: "Dynamo detected a call to a `functools.lru_cache`-wrapped function"), where a
dict lookup traces silently."""

import torch

_CAPABILITY: dict[torch.device, tuple[int, int]] = {}
_SMS: dict[torch.device, int] = {}


def compute_capability(device: torch.device) -> tuple[int, int]:
    """The (major, minor) compute capability of CUDA ``device``: 9 is Hopper."""
    if device not in _CAPABILITY:
        _CAPABILITY[device] = torch.cuda.get_device_capability(device)
    return _CAPABILITY[device]


def num_sms(device: torch.device) -> int:
    """The number of streaming multiprocessors of CUDA ``device``."""
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return _SMS[device]
