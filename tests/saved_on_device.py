"""What torch.save records of a GPU's tensors, on a CPU build: each storage's location is its
device ("cuda:0"), as torch's cuda tagger records it, and its bytes are the host copy torch.save
writes of it. Asked through torch's own tagger registry (torch.serialization.register_package),
after slurm_autosp's own tagger (priority 0) and before torch's cpu one (10)."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_device = threading.local()
torch.serialization.register_package(
    5, lambda storage: getattr(_device, "location", None), lambda storage, location: None
)


@contextmanager
def saved_on(location: str) -> Iterator[None]:
    """torch.save on this thread records every storage at `location`, as it would on that GPU."""
    _device.location = location
    try:
        yield
    finally:
        _device.location = None
