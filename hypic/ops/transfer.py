"""Host → device copies that do not stall the host.

A copy from ordinary (pageable) host memory makes the host wait until the GPU has run everything
queued before it, so one such copy inside a forward serialises host and device time. Index tensors
built on the host go through pinned memory with a non-blocking copy instead: the copy is queued in
order on the stream and the host runs ahead. (PyTorch keeps a pinned buffer alive until its copy
has run.)
"""

from __future__ import annotations

import torch
from torch import Tensor


def to_device(data: Tensor | list | tuple, device: torch.device | str,
              dtype: torch.dtype | None = torch.long) -> Tensor:
    """``data`` (a host tensor or a nested list of numbers) on ``device``, queued without a host stall."""
    t = data if isinstance(data, Tensor) else torch.tensor(data, dtype=dtype)
    device = torch.device(device)
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    if torch.cuda.is_current_stream_capturing():
        # a captured copy would re-read this pinned buffer at every replay, long after it is freed
        raise RuntimeError("to_device: a host → device copy inside a CUDA graph capture")
    return t.pin_memory().to(device, non_blocking=True)


def copy_to(dst: Tensor, src: Tensor) -> None:
    """Host tensor ``src`` copied into ``dst`` in place (a fixed buffer a captured step reads), queued
    without a host stall when ``dst`` is on the GPU."""
    if dst.device.type == "cuda" and src.device.type == "cpu":
        dst.copy_(src.pin_memory(), non_blocking=True)
    else:
        dst.copy_(src)


def to_device_many(parts: list[Tensor], device: torch.device | str) -> list[Tensor]:
    """Several 1-D host tensors of one dtype on ``device`` in one copy (one pinned buffer, one
    transfer), returned as views in order."""
    sizes = [len(p) for p in parts]
    return list(to_device(torch.cat(parts), device, None).split(sizes))
