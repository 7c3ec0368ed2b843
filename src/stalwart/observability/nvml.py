"""NVML for the GPU probes (energy, the straggler detector's GPU fields): the one place that
imports ``pynvml`` (package ``nvidia-ml-py``, the ``nvml`` extra), lazily, and finds this rank's
device by UUID (``CUDA_VISIBLE_DEVICES`` renumbers devices, NVML does not)."""

from __future__ import annotations

from typing import Any

import torch


def open_nvml_handle(device: torch.device) -> tuple[Any, Any]:
    """Initialise NVML and return ``(pynvml, handle)`` of ``device``.

    Raises:
        RuntimeError: with the reason (not a CUDA device, pynvml missing, NVML failed).
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        raise RuntimeError(f"device is {device}, not a CUDA GPU")
    try:
        import pynvml
    except ImportError as exc:
        raise RuntimeError("pynvml missing: pip install nvidia-ml-py") from exc
    try:
        pynvml.nvmlInit()
    except Exception as exc:  # NVMLError has many subclasses; the message is what matters
        raise RuntimeError(f"nvmlInit failed: {exc}") from exc
    index = device.index if device.index is not None else torch.cuda.current_device()
    try:
        uuid = str(torch.cuda.get_device_properties(index).uuid)
        name = uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"
        handle = pynvml.nvmlDeviceGetHandleByUUID(name)
    except Exception:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    return pynvml, handle
