"""The only places an engine step crosses between host and device.

A step uploads its host data once (`upload`: every per-step integer and float
array packed into one pinned buffer, copied non-blocking) and reads its
results once (`download`). On a GPU each crossing can stall the stream, so
they are counted: `TransferCounter` is how tests and benchmarks hold the step
to its budget (at most two crossings in the common path; logprobs add one).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

_counters = threading.local()


class TransferCounter:
    """Counts uploads and downloads made by this thread while active (nests)."""

    def __init__(self) -> None:
        self.uploads = 0
        self.downloads = 0

    @property
    def total(self) -> int:
        return self.uploads + self.downloads

    def __enter__(self) -> TransferCounter:
        stack = getattr(_counters, "stack", None)
        if stack is None:
            stack = _counters.stack = []
        stack.append(self)
        return self

    def __exit__(self, *exc) -> None:
        _counters.stack.remove(self)


def _count(kind: str) -> None:
    for counter in getattr(_counters, "stack", ()):
        setattr(counter, kind, getattr(counter, kind) + 1)


@dataclass
class HostBuffer:
    """Named host arrays gathered while a step is prepared, uploaded in one copy.

    Integers are stored as int64, floats as float64 bit patterns in the same
    int64 buffer, so one contiguous copy carries both.
    """

    _chunks: list[torch.Tensor] = field(default_factory=list)
    _slices: dict[str, tuple[int, int, torch.dtype]] = field(default_factory=dict)
    _size: int = 0

    def ints(self, name: str, values) -> None:
        self._add(name, torch.as_tensor(values, dtype=torch.int64), torch.int64)

    def floats(self, name: str, values) -> None:
        self._add(name, torch.as_tensor(values, dtype=torch.float64).view(torch.int64), torch.float64)

    def bools(self, name: str, values) -> None:
        self._add(name, torch.as_tensor(values, dtype=torch.int64), torch.bool)

    def _add(self, name: str, flat: torch.Tensor, dtype: torch.dtype) -> None:
        assert name not in self._slices, name
        flat = flat.reshape(-1)
        self._slices[name] = (self._size, flat.numel(), dtype)
        self._chunks.append(flat)
        self._size += flat.numel()

    def upload(self, device: torch.device) -> DeviceArrays:
        """One host->device copy of everything added; views by name on the device."""
        host = torch.cat(self._chunks) if self._chunks else torch.zeros(0, dtype=torch.int64)
        if device.type == "cuda":
            host = host.pin_memory()
        _count("uploads")
        data = host.to(device, non_blocking=True)
        return DeviceArrays(data, self._slices)


@dataclass
class DeviceArrays:
    data: torch.Tensor
    slices: dict[str, tuple[int, int, torch.dtype]]

    def __contains__(self, name: str) -> bool:
        return name in self.slices

    def __getitem__(self, name: str) -> torch.Tensor:
        start, size, dtype = self.slices[name]
        flat = self.data[start : start + size]
        if dtype is torch.float64:
            return flat.view(torch.float64)
        if dtype is torch.bool:
            return flat != 0
        return flat


def download(*tensors: torch.Tensor) -> list[list]:
    """One device->host read of a step's results: the tensors are packed into
    one int64 buffer (floats as float64 bits), copied, and split again on the
    host. Returns each tensor as (nested) Python lists."""
    flat = []
    for t in tensors:
        t = t.reshape(-1)
        flat.append(t.to(torch.float64).view(torch.int64) if t.is_floating_point() else t.to(torch.int64))
    _count("downloads")
    host = torch.cat(flat).cpu() if flat else torch.zeros(0, dtype=torch.int64)
    out, offset = [], 0
    for t in tensors:
        part = host[offset : offset + t.numel()]
        offset += t.numel()
        out.append((part.view(torch.float64) if t.is_floating_point() else part).reshape(t.shape).tolist())
    return out
