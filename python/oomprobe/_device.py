"""What both framework hooks ask of the device: the memory a prediction runs against, and the
flags a CPU's step needs."""

from __future__ import annotations

from typing import Any, Mapping

# On a CPU: its autocast lists and SDPA kernels, and its dropout, which saves its noise in the
# input's type (aten's Dropout.cpp fuses to native_dropout only on CUDA, XPU and the like).
CPU_FLAGS = {"autocast_device": "cpu", "dropout_mask": "input"}


def memory_flags(device: Any, memory: Any, flags: Mapping[str, Any]) -> dict:
    """`memory=` as given; nothing when `gpu=` names a card; on a CUDA device the card's memory
    and what lives outside PyTorch's allocator on it now (total − free − reserved: the CUDA
    context, workspaces, other processes). Elsewhere a memory is needed: ValueError."""
    if memory is not None:
        return {"memory": str(memory)}
    if "gpu" in flags:
        return {}
    if device.type != "cuda":
        raise ValueError(f"memory= is needed for a {device.type} device")
    import torch

    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return {"memory": str(total), "non_pytorch": str(max(0, total - free - reserved))}


def tensors_only(device: Any, given: Any = None) -> bool:
    """No caching allocator sits between a CPU's tensors and its memory."""
    return device.type == "cpu" if given is None else bool(given)
