"""Version-tolerant wrappers over ``torch.distributed.checkpoint`` (DCP) for torch >= 2.4.

Newer keyword arguments (``no_dist``, ``async_stager``, ``allow_partial_load``) and the
``DefaultStager``/``StagingOptions`` staging API are feature-detected, so the same code runs on
torch 2.4 through 2.13, with or without an initialised process group. Loads read through
`stalwart.checkpoint.dcp_safe` (no pickle from the checkpoint runs code).

``torch.distributed.checkpoint`` is imported inside the functions that save, load or gather
state, never at module import: it costs ~1.5 s per process (most of it
``torch.distributed.tensor``), which every launch that never touches a checkpoint (a run without
``--save``, a CLI error, a tool) would pay.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import enum
import inspect
import logging
import warnings
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from stalwart.checkpoint.optimizer_state import (
    canonical_learning_rates,
    keep_optimizer_implementation,
)
from stalwart.tensor_tree import map_tensors

MODEL_KEY = "model"
OPTIM_KEY = "optim"


class StagingMode(enum.Enum):
    """How an async save copies state to host memory before the background write."""

    PINNED_STAGER = "DefaultStager, pinned host memory"
    PAGEABLE_STAGER = "DefaultStager, pageable host memory (pinned memory needs CUDA)"
    MANUAL_COPY = "own host copy + background thread (DefaultStager not available)"


def _accepts(fn: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


def _dist_on() -> bool:
    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group; single process is intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*")
        yield


@contextlib.contextmanager
def _dcp_errors_as_runtime_error() -> Iterator[None]:
    """DCP reports a failed collective save/load as ``CheckpointException``, a BaseException:
    callers' ``except Exception`` would miss it (a full disk then escaped as a traceback and left
    the partial directory behind). Re-raise it as a RuntimeError naming each rank's cause."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        raise RuntimeError(describe_failure(exc)) from exc


_WEIGHTS_ONLY = "Weights only load failed"


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    if lines and lines[0].startswith(_WEIGHTS_ONLY):
        # torch's first line advises weights_only=False, which would run whatever the damaged
        # or planted bytes hold; the reason is further down (e.g. "Unsupported operand 0").
        reason = next(
            (ln for ln in lines[1:] if not ln.startswith(("Please file", "Check the"))), ""
        )
        return (
            f"{type(err).__name__}: not a tensor torch reads safely (damaged or foreign data)"
            + (f": {reason.rstrip(': ')}" if reason else "")
        )
    return f"{type(err).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def describe_failure(exc: BaseException) -> str:
    """One line for a failed DCP save/load: each failing rank's exception type and first message
    line (DCP's ``CheckpointException`` text holds every rank's whole traceback)."""
    from torch.distributed.checkpoint.api import CheckpointException

    if isinstance(exc, CheckpointException):
        failures = getattr(exc, "failures", {}) or {}
        by_cause: dict[str, list[int]] = {}
        for rank, err in sorted(failures.items()):
            by_cause.setdefault(_first_line(err[0] if isinstance(err, tuple) else err), []).append(
                rank
            )
        causes = "; ".join(
            f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}: {cause}"
            for cause, ranks in by_cause.items()
        )
        return causes or _first_line(exc)
    if isinstance(exc, RuntimeError) and isinstance(exc.__cause__, CheckpointException):
        return str(exc)  # already described by _dcp_errors_as_runtime_error
    return " ".join(str(exc).split()) or type(exc).__name__


def _dist_kwargs(fn: Callable[..., Any], group: Any) -> dict[str, Any]:
    if _dist_on():
        return {"process_group": group}
    return {"no_dist": True} if _accepts(fn, "no_dist") else {}


def gather_state(
    model: nn.Module, optimizer: Optimizer | None, *, for_save: bool = False
) -> dict[str, Any]:
    """Model (and optimizer) state keyed by clean FQNs (no DDP ``module.`` prefix), DCP-ready.

    torch's ``get_state_dict`` initialises an optimizer without state by running one step with
    zero gradients (it needs the state's structure); that step counts (``step`` becomes 1). A
    load wants that structure to read into. A save before the first optimizer step must not
    keep it: ``for_save=True`` saves no per-parameter state and puts the live optimizer back the
    way it was, so the run goes on exactly as without the save (and the resume, finding no state,
    leaves the optimizer fresh, see :func:`load_into`).
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer is None:
        return {MODEL_KEY: get_model_state_dict(model)}
    had_state = bool(optimizer.state)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    if for_save and not had_state:
        optimizer.state.clear()  # undo the initialising step (its grads are already None again)
        optim_sd = {**optim_sd, "state": {}}
    return {MODEL_KEY: model_sd, OPTIM_KEY: canonical_learning_rates(optim_sd)}


def apply_state(
    model: nn.Module, optimizer: Optimizer | None, state: dict[str, Any], strict: bool
) -> None:
    """Push a loaded :func:`gather_state` dict back into the model (and optimizer)."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_state_dict,
    )

    options = StateDictOptions(strict=strict)
    if optimizer is None:
        set_model_state_dict(model, state[MODEL_KEY], options=options)
        return
    with keep_optimizer_implementation(optimizer):
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state[MODEL_KEY],
            optim_state_dict=state[OPTIM_KEY],
            options=options,
        )


def save_sync(state: dict[str, Any], path: str, group: Any) -> None:
    """Blocking DCP save of ``state`` into directory ``path`` (collective when a group exists)."""
    import torch.distributed.checkpoint as dcp

    with _quiet_single_process(), _dcp_errors_as_runtime_error():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(path), **_dist_kwargs(dcp.save, group))


def load_into(state: dict[str, Any], path: str, group: Any, strict: bool) -> None:
    """Fill the tensors of ``state`` in place from the DCP checkpoint in ``path``.

    Optimizer state of parameters that the checkpoint has none for (saved before their first
    optimizer step: torch initialises it for the load) is dropped from ``state`` first, so the
    load leaves those parameters as the saving job had them: without state.
    """
    import torch.distributed.checkpoint as dcp

    from stalwart.checkpoint.dcp_readers import SafeFileSystemReader, SafeLoadPlanner

    reader = SafeFileSystemReader(path)
    prune_unsaved_optimizer_state(state, reader.read_metadata().state_dict_metadata)
    kwargs = _dist_kwargs(dcp.load, group)
    if not strict and _accepts(dcp.DefaultLoadPlanner, "allow_partial_load"):
        kwargs["planner"] = SafeLoadPlanner(allow_partial_load=True)
    else:
        kwargs["planner"] = SafeLoadPlanner()
    with _quiet_single_process(), _dcp_errors_as_runtime_error():
        dcp.load(state, storage_reader=reader, **kwargs)


def prune_unsaved_optimizer_state(state: dict[str, Any], saved_keys: Any) -> list[str]:
    """Drop ``state["optim"]["state"][fqn]`` for every parameter without a saved
    ``optim.state.<fqn>.*`` key; returns the dropped names."""
    per_param = state.get(OPTIM_KEY, {}).get("state")
    if not isinstance(per_param, dict):
        return []
    prefix = f"{OPTIM_KEY}.state."
    saved = {key[len(prefix) :] for key in saved_keys if key.startswith(prefix)}
    dropped = [
        fqn
        for fqn, entries in per_param.items()
        if not any(f"{fqn}.{name}" in saved for name in entries)
    ]
    for fqn in dropped:
        del per_param[fqn]
    return dropped


def new_checkpoint_group(group: Any) -> Any:
    """A gloo group mirroring ``group`` for background DCP collectives; None without a group.

    Collective over ``group``: every member must call it. The async writer runs DCP's planning
    collectives on its own thread, so it must not share a communicator with the training loop
    (interleaved collectives from two threads on one group can deadlock), and async DCP needs a
    CPU-capable backend even when training uses NCCL.
    """
    if not _dist_on():
        return None
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    return dist.new_group(ranks=ranks, backend="gloo")


def _host_copy(obj: Any, pin: bool) -> Any:
    """Deep copy of every tensor in a nested state dict into (optionally pinned) host memory."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        if type(t) is not torch.Tensor:  # DTensor & co.: keep the wrapper, copy its data
            return t.detach().clone().cpu()
        out = torch.empty_like(t, device="cpu", pin_memory=pin)
        out.copy_(t.detach())
        return out

    return map_tensors(obj, copy)


class AsyncWriter:
    """Starts background DCP saves; the caller only blocks while state is copied to host memory.

    Uses ``dcp.async_save`` with a reusable ``DefaultStager`` (pinned memory when CUDA exists) when
    the installed torch offers it; otherwise copies state to host memory itself and runs a blocking
    ``dcp.save`` on one worker thread. Either way the returned future completes once this rank's
    shards (and, on the coordinator, ``.metadata``) are written.
    """

    def __init__(self, group: Any, log: logging.Logger) -> None:
        self._group = group
        self._log = log
        self._pin = torch.cuda.is_available()
        self._stager: Any = None
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None
        self._after: concurrent.futures.ThreadPoolExecutor | None = None
        self.mode = self._choose_mode()
        if self.mode is StagingMode.MANUAL_COPY:
            self._use_manual_copy()
        log.info("async checkpoint save: %s", self.mode.value)

    def _use_manual_copy(self) -> None:
        if self._stager is not None:
            with contextlib.suppress(Exception):
                self._stager.close()
        self._stager = None
        self.mode = StagingMode.MANUAL_COPY
        self._executor = concurrent.futures.ThreadPoolExecutor(1, "stalwart-ckpt")

    def _choose_mode(self) -> StagingMode:
        import torch.distributed.checkpoint as dcp

        try:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        except ImportError:
            return StagingMode.MANUAL_COPY
        needed = ["async_stager"] + ([] if _dist_on() else ["no_dist"])
        if not all(_accepts(dcp.async_save, name) for name in needed):
            return StagingMode.MANUAL_COPY
        # Synchronous staging: save() returns only when the host copy is done, so the caller may
        # update parameters immediately; the write itself is the background part.
        options = StagingOptions(
            use_pinned_memory=self._pin,
            use_shared_memory=False,
            use_async_staging=False,
            use_non_blocking_copy=self._pin,
        )
        self._stager = DefaultStager(options)
        return StagingMode.PINNED_STAGER if self._pin else StagingMode.PAGEABLE_STAGER

    def start(
        self,
        state: dict[str, Any],
        path: str,
        then: Callable[[str], None] | None = None,
    ) -> concurrent.futures.Future:
        """Stage ``state`` to host memory (blocking), then write it to ``path`` in the background;
        ``then(path)`` runs on a background thread after this rank's write (the checksums)."""
        written = self._start_write(state, path)
        if then is None:
            return written
        if self._after is None:
            self._after = concurrent.futures.ThreadPoolExecutor(1, "stalwart-ckpt-after")
        return self._after.submit(_after_write, written, then, path)

    def _start_write(self, state: dict[str, Any], path: str) -> concurrent.futures.Future:
        import torch.distributed.checkpoint as dcp

        writer = dcp.FileSystemWriter(path)
        if self._executor is not None:
            staged = _host_copy(state, self._pin)
            group = self._group
            return self._executor.submit(save_sync, staged, path, group)
        try:
            with _quiet_single_process():
                result = dcp.async_save(
                    state,
                    storage_writer=writer,
                    async_stager=self._stager,
                    **_dist_kwargs(dcp.async_save, self._group),
                )
        except Exception as exc:
            # Staging runs before any write or collective, so nothing is lost by retrying. Seen on
            # torch 2.11: DefaultStager's deep copy raises KeyError(<class 'type'>) for CPU state.
            self._log.warning(
                "async checkpoint: DefaultStager failed (%s: %s); using %s from now on",
                type(exc).__name__,
                exc,
                StagingMode.MANUAL_COPY.value,
            )
            self._use_manual_copy()
            return self._start_write(state, path)
        # Newer torch may return AsyncSaveResponse(staging_completion, upload_completion).
        return cast(concurrent.futures.Future, getattr(result, "upload_completion", result))

    def close(self, wait: bool = True) -> None:
        """Release the stager's host buffers and the worker thread (``wait=False``: don't join)."""
        for pool in (self._executor, self._after):
            if pool is not None:
                pool.shutdown(wait=wait)
        self._executor = self._after = None
        if self._stager is not None and wait:
            with contextlib.suppress(Exception):
                self._stager.close()
        self._stager = None


def _after_write(
    written: concurrent.futures.Future, then: Callable[[str], None], path: str
) -> None:
    written.result()  # the write's own failure is the save's failure
    then(path)


def group_rank_info(group: Any) -> tuple[int, int, int]:
    """(rank in ``group``, its size, global rank of its rank 0); (0, 1, 0) without a group."""
    if not _dist_on():
        return 0, 1, 0
    src = dist.get_global_rank(group, 0) if group is not None else 0
    return dist.get_rank(group), dist.get_world_size(group), src
