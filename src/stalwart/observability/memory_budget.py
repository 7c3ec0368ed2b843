"""Will it fit? Available memory of a device, compared with an estimate before allocating.

A job whose model or micro-batch cannot fit should be refused in one line before it allocates,
not die in an allocation traceback minutes later or, on CPU, swap until the machine stalls.
`available_memory` reads what the device can still give (CUDA: ``torch.cuda.mem_get_info``, free
bytes; CPU: ``psutil.virtual_memory().available``, else ``MemAvailable`` of ``/proc/meminfo``,
shared by the ranks of one node); `check_fits` raises ``ValueError`` when an estimate exceeds it::

    est = theoretical_memory(cfg, micro_batch_size=8, dp_size=world)  # stalwart.models.memory_model
    available, where = available_memory(device, ranks_sharing=local_world_size)
    check_fits(est.total_bytes, available, where=where, cause="lower --micro-batch-size")

The estimate should be a lower bound (`theoretical_memory` is: it leaves out fragmentation and the
CUDA context), so that only jobs that certainly cannot fit are refused.
"""

from __future__ import annotations

import torch

GIB = float(1 << 30)


def _meminfo_available() -> float | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024.0
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_memory(device: torch.device, ranks_sharing: int = 1) -> tuple[float | None, str]:
    """``(bytes this process may still use, description)``; bytes None when unknown.

    CPU memory is shared by the ``ranks_sharing`` processes of this node: each gets its share.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return float(free), f"{device} has {free / GIB:.1f} GiB free"
    try:
        import psutil

        total = float(psutil.virtual_memory().available)
    except ImportError:
        maybe = _meminfo_available()
        if maybe is None:
            return None, "available memory unknown"
        total = maybe
    share = max(ranks_sharing, 1)
    where = f"the host has {total / GIB:.1f} GiB available"
    if share > 1:
        where += f" ({total / share / GIB:.1f} GiB for each of {share} ranks on this node)"
    return total / share, where


def check_fits(needed: float, available: float | None, *, where: str, cause: str) -> None:
    """``ValueError`` when ``needed`` bytes exceed ``available`` (unknown: no check).

    ``cause`` names the flags and values responsible; ``where`` describes ``available``.
    """
    if available is None or needed <= available:
        return
    raise ValueError(
        f"does not fit in memory: needs at least {needed / GIB:.3g} GiB (theoretical estimate) "
        f"but {where}: {cause}"
    )
