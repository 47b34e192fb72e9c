"""A stand-in for the GPU's "Expected all tensors to be on the same device": on CPU ranks every
tensor is on the CPU, so a tensor our code makes without naming its device (which on a GPU
run is a CPU tensor beside CUDA ones) goes unnoticed. Inside `names_devices()`, every tensor
factory that package code calls (torch.tensor, zeros, full, ...) without `device=` is recorded
with its file and line; libraries' own factories are theirs. A host tensor made on purpose
names device="cpu"."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

PACKAGE = Path(__file__).resolve().parents[1] / "slurm_autosp"
# the frames between a factory's caller and the mode (torch's function-override machinery)
DISPATCH = frozenset(
    Path(module.__file__).resolve() for module in (torch.overrides, torch.utils._device)
)
FACTORIES = frozenset(
    {
        torch.tensor,
        torch.as_tensor,
        torch.zeros,
        torch.ones,
        torch.empty,
        torch.full,
        torch.arange,
        torch.rand,
        torch.randn,
        torch.randint,
        torch.eye,
        torch.linspace,
    }
)


class _DeviceNaming(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.unnamed: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in FACTORIES and kwargs.get("device") is None:
            caller = _direct_caller()
            if caller is not None:
                self.unnamed.append(caller)
        return func(*args, **kwargs)


def _direct_caller() -> str | None:
    """file:line of the package code that called the factory itself; None when a library or
    torch (on behalf of our code, e.g. a norm's own scalars) did."""
    frame = sys._getframe(2)
    while frame is not None and Path(frame.f_code.co_filename).resolve() in DISPATCH:
        frame = frame.f_back
    if frame is None:
        return None
    path = Path(frame.f_code.co_filename).resolve()
    return (
        f"{path.relative_to(PACKAGE.parent)}:{frame.f_lineno}"
        if path.is_relative_to(PACKAGE)
        else None
    )


@contextlib.contextmanager
def names_devices() -> Iterator[list[str]]:
    """Yields the list of places that made a tensor without naming its device."""
    mode = _DeviceNaming()
    with mode:
        yield mode.unnamed
