"""Metric sinks: where scalars go (TensorBoard, Weights & Biases, JSON lines, nowhere).

Every sink implements :class:`MetricSink`. Callers write through one sink object; to reach several
back-ends they use :class:`FanOutSink`, which forwards each call to every child, so TensorBoard and
W&B always receive the same keys at the same steps ("written in pairs", as Megatron intends but
does by hand). Only **rank 0** writes metrics: :func:`build_sinks` returns a :class:`NullSink` on
every other rank. (Megatron uses the last rank because losses live on the last pipeline stage;
stalwart's trainer has its losses on rank 0.)

Tag names: the TensorBoard and W&B sinks write Megatron's flat keys (``lm loss``,
``learning-rate``, ``forward-backward-time``), so Megatron dashboards keep working; pass
``grouped=True`` (``--group-metric-tags``) for one ``<group>/`` prefix per key
(`stalwart.observability.metric_names.grouped_name`: ``loss/lm loss``,
``timers/forward-backward-time``).

Optional dependencies (``tensorboard``, ``wandb``) are imported when a sink is constructed.
"""

from __future__ import annotations

import contextlib
import enum
import importlib
import json
import logging
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast, runtime_checkable

from stalwart.atomic_file import Sync, write_text_atomic
from stalwart.observability.metric_names import VS_SAMPLES_SUFFIX, grouped_name

logger = logging.getLogger(__name__)
_TAIL_CHUNK = 1 << 20


class WandbMode(enum.Enum):
    """``--wandb-mode``: what ``wandb.init(mode=...)`` receives."""

    ONLINE = "online"
    OFFLINE = "offline"
    DISABLED = "disabled"


def _check_wandb_mode(mode: object) -> None:
    # A string would reach wandb unchecked: the caller parses it once, ``WandbMode("offline")``.
    if mode is not None and not isinstance(mode, WandbMode):
        raise TypeError(f"the W&B mode must be a WandbMode or None, got {mode!r}")


# Keys ending in VS_SAMPLES_SUFFIX use consumed samples as their x-axis (Megatron's "vs samples").


@runtime_checkable
class MetricSink(Protocol):
    """Destination for scalar metrics. ``step`` is the x-axis value (iteration or samples)."""

    def add_scalar(self, name: str, value: float, step: int) -> None: ...
    def add_scalars(self, values: Mapping[str, float], step: int) -> None: ...
    def add_text(self, name: str, text: str, step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


class NullSink:
    """Writes nothing. The sink of every non-zero rank and of runs without metric back-ends."""

    def add_scalar(self, name: str, value: float, step: int) -> None: ...
    def add_scalars(self, values: Mapping[str, float], step: int) -> None: ...
    def add_text(self, name: str, text: str, step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


def is_null_sink(sink: MetricSink) -> bool:
    """True when writing to ``sink`` has no effect (lets callers skip computing the values).

    Exact type check: a subclass that overrides the methods is a real sink.
    """
    return type(sink) is NullSink


def _flat_name(key: str) -> str:
    return key


class TensorBoardSink:
    """TensorBoard event files under ``log_dir`` (``--tensorboard-dir``); Megatron's flat tags,
    or grouped ones with ``grouped=True``."""

    def __init__(self, log_dir: str, max_queue: int = 1000, grouped: bool = False) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is an optional dependency
            raise ImportError(
                "--tensorboard-dir needs the 'tensorboard' package: pip install "
                "'stalwart[tensorboard]'"
            ) from exc
        self.log_dir = log_dir
        self._tag = grouped_name if grouped else _flat_name
        self._writer = SummaryWriter(log_dir=log_dir, max_queue=max_queue)

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self._writer.add_scalar(self._tag(name), value, step)

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        # One tag per key (SummaryWriter.add_scalars would create one sub-run per key instead).
        for name, value in values.items():
            self._writer.add_scalar(self._tag(name), value, step)

    def add_text(self, name: str, text: str, step: int) -> None:
        self._writer.add_text(self._tag(name), text, step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run (``--wandb-project``, ``--wandb-exp-name``, ``--wandb-save-dir``).

    ``mode`` (``--wandb-mode``) is a :class:`WandbMode` (a string raises ``TypeError``); ``None``
    lets wandb read ``WANDB_MODE`` from the environment. W&B needs a monotonic step, so the sink
    does not pass ``step=`` to W&B: it logs each call as one row with an explicit x-axis column,
    ``iteration`` for ordinary keys and ``samples`` for ``"... vs samples"`` keys (declared with
    ``define_metric``).

    ``resume_file`` (the trainer passes ``<run dir>/wandb_run_id.txt``) keeps one W&B run across
    restarts: the first start writes its run id there, every later start (torchrun restart,
    in-process restart, relaunch after exit 16/17) continues that run (``resume="allow"``)
    instead of scattering the job over several runs.

    Keys are grouped exactly as in :class:`TensorBoardSink` (``grouped``), so both back-ends show
    the same tags. A run that does not start (``wandb.init`` raised: no login, a refused key) is
    a ``ValueError`` of one line naming ``--wandb-project``, and the save directories this
    construction made are removed again.
    """

    def __init__(
        self,
        project: str,
        exp_name: str | None = None,
        save_dir: str | None = None,
        config: Mapping[str, Any] | None = None,
        mode: WandbMode | None = None,
        resume_file: str | None = None,
        grouped: bool = False,
    ) -> None:
        self._tag = grouped_name if grouped else _flat_name
        _check_wandb_mode(mode)
        if not project:
            raise ValueError("--wandb-project must be a non-empty string")
        try:
            import wandb
        except ImportError as exc:  # wandb is an optional dependency
            raise ImportError(
                "--wandb-project needs the 'wandb' package: pip install 'stalwart[wandb]'"
            ) from exc
        created = _make_dirs(save_dir)
        run_id = _read_run_id(resume_file)
        wandb_mode = cast(Any, None if mode is None else mode.value)  # its stub wants a Literal
        try:
            self._run = wandb.init(
                project=project,
                name=exp_name,
                dir=save_dir,
                config=dict(config or {}),
                mode=wandb_mode,
                id=run_id,
                resume="allow" if run_id else None,
            )
        except Exception as exc:  # no login, a refused key, no server: wandb's own error types
            for path in reversed(created):  # what this start made for W&B, while still empty
                with contextlib.suppress(OSError):
                    os.rmdir(path)
            raise ValueError(_wandb_start_failure(project, exc)) from None
        if resume_file and not run_id:
            _write_run_id(resume_file, str(self._run.id))
        self._run.define_metric("iteration")
        self._run.define_metric("samples")
        self._defined: set[str] = set()

    @property
    def run_dir(self) -> str:
        """Directory of this run's files (``.../wandb/<run>/files``)."""
        return str(self._run.dir)

    def _define(self, name: str) -> str:
        # ``name`` is already the grouped tag; the suffix stays at its end.
        axis = "samples" if name.endswith(VS_SAMPLES_SUFFIX) else "iteration"
        if name not in self._defined:
            self._run.define_metric(name, step_metric=axis)
            self._defined.add(name)
        return axis

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.add_scalars({name: value}, step)

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        by_axis: dict[str, dict[str, float]] = {}
        for key, value in values.items():
            name = self._tag(key)
            by_axis.setdefault(self._define(name), {})[name] = float(value)
        for axis, row in by_axis.items():
            self._run.log({axis: step, **row})

    def add_text(self, name: str, text: str, step: int) -> None:
        self._run.summary[self._tag(name)] = text

    def flush(self) -> None:
        return None  # wandb streams in the background; finish() in close() drains it.

    def close(self) -> None:
        self._run.finish()


def _make_dirs(path: str | None) -> list[str]:
    """``os.makedirs(path)``; the directories it created, outermost first."""
    if not path:
        return []
    missing: list[str] = []
    head = os.path.abspath(path)
    while not os.path.exists(head):
        missing.insert(0, head)
        head = os.path.dirname(head)
    os.makedirs(path, exist_ok=True)
    return missing


def _wandb_start_failure(project: str, exc: Exception) -> str:
    """One line for a W&B run that did not start (wandb's message is its first line)."""
    said = next((ln.strip() for ln in str(exc).splitlines() if ln.strip()), "")
    return (
        f"--wandb-project {project}: W&B did not start a run ({type(exc).__name__}"
        + (f": {said[:300]}" if said else "")
        + "): log in with `wandb login` or set WANDB_API_KEY, or pass --wandb-mode offline "
        "(sync later with `wandb sync`)"
    )


def _read_run_id(path: str | None) -> str | None:
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip() or None
    except FileNotFoundError:
        return None


def _write_run_id(path: str, run_id: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    # A crash never leaves a half-written id behind.
    write_text_atomic(path, run_id + "\n", sync=Sync.NONE)


def _json_number(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become null (the nan counters say why)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def heal_torn_tail(path: str | os.PathLike[str]) -> int:
    """Before appending to a JSON-lines file: drop a torn last record (a crash mid-write left
    bytes after the last newline), so the next record starts on its own line instead of being
    glued to the garbage and lost with it. Returns the number of bytes dropped (0 if none or the
    file is absent); logs one warning when it drops something.
    """
    try:
        with open(path, "r+b") as f:
            size = f.seek(0, os.SEEK_END)
            if size == 0:
                return 0
            f.seek(size - 1)
            if f.read(1) == b"\n":
                return 0
            start = max(0, size - _TAIL_CHUNK)
            f.seek(start)
            newline = f.read(size - start).rfind(b"\n")
            if newline < 0 and start > 0:  # a torn record longer than the chunk: terminate it
                f.seek(size)
                f.write(b"\n")
                keep = size
            else:
                keep = start + newline + 1
                f.truncate(keep)
    except FileNotFoundError:
        return 0
    except OSError as exc:
        logger.warning("cannot check the tail of %s: %s", path, exc.strerror or exc)
        return 0
    dropped = size - keep
    if dropped:
        logger.warning("%s: dropped a torn last record (%d bytes, left by a crash)", path, dropped)
    return dropped


def append_line(path: str | os.PathLike[str], line: str) -> None:
    """Append one line (``line`` without its newline) after healing a torn tail."""
    heal_torn_tail(path)
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


class JsonlSink:
    """JSON lines file (``--metrics-file``): one object per step, ``{"step": s, key: value, ...}``.

    Scalars for the same step are grouped into one line; a line is written when the step changes
    or on ``flush``/``close``. :meth:`write_record` writes one complete object immediately.
    """

    def __init__(self, path: str) -> None:
        parent = os.path.dirname(os.path.abspath(path))
        os.makedirs(parent, exist_ok=True)
        self.path = path
        heal_torn_tail(path)  # a crash mid-line must not swallow this run's first record
        self._file = open(path, "a", encoding="utf-8")  # noqa: SIM115 -- closed by close()
        self._pending_step: int | None = None
        self._pending: dict[str, Any] = {}

    def write_record(self, record: Mapping[str, Any]) -> None:
        """Write ``record`` as one line now (flushed so a crash loses at most this line)."""
        self.write_records((record,))

    def write_records(self, records: Iterable[Mapping[str, Any]]) -> None:
        """Write each of ``records`` as one line now, then flush once (a log step's rows)."""
        self._flush_pending()
        for record in records:
            clean = {k: _json_number(v) for k, v in record.items()}
            self._file.write(json.dumps(clean, allow_nan=False) + "\n")
        self._file.flush()

    def add_scalar(self, name: str, value: float, step: int) -> None:
        self.add_scalars({name: value}, step)

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        if self._pending_step is not None and step != self._pending_step:
            self._flush_pending()
        self._pending_step = step
        self._pending.update(values)

    def add_text(self, name: str, text: str, step: int) -> None:
        self.add_scalars({name: text}, step)  # type: ignore[dict-item]

    def _flush_pending(self) -> None:
        if self._pending_step is None:
            return
        record = {"step": self._pending_step, **self._pending}
        self._pending_step, self._pending = None, {}
        self.write_record(record)

    def flush(self) -> None:
        self._flush_pending()
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


class FanOutSink:
    """Forwards every call to each child, in order, so all back-ends get identical keys and
    steps."""

    def __init__(self, children: Sequence[MetricSink]) -> None:
        self.children: tuple[MetricSink, ...] = tuple(children)

    def add_scalar(self, name: str, value: float, step: int) -> None:
        for child in self.children:
            child.add_scalar(name, value, step)

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        for child in self.children:
            child.add_scalars(values, step)

    def add_text(self, name: str, text: str, step: int) -> None:
        for child in self.children:
            child.add_text(name, text, step)

    def flush(self) -> None:
        for child in self.children:
            child.flush()

    def close(self) -> None:
        for child in self.children:
            child.close()


def build_sinks(
    *,
    rank: int,
    tensorboard_dir: str | None = None,
    tensorboard_queue_size: int = 1000,
    wandb_project: str | None = None,
    wandb_exp_name: str | None = None,
    wandb_save_dir: str | None = None,
    wandb_mode: WandbMode | None = None,
    wandb_resume_file: str | None = None,
    config: Mapping[str, Any] | None = None,
    grouped: bool = False,
) -> MetricSink:
    """The sink for this rank from config values: NullSink unless rank 0 configured a back-end.

    One back-end is returned as is; TensorBoard + W&B are wrapped in a :class:`FanOutSink`.
    ``wandb_save_dir`` defaults to ``<tensorboard_dir>/wandb`` when TensorBoard is on, else cwd.
    ``grouped`` (``--group-metric-tags``): ``<group>/<key>`` tags on both back-ends, else
    Megatron's flat keys.

    Raises:
        TypeError: ``wandb_mode`` is not a :class:`WandbMode` (or None), on every rank.
        ValueError: W&B did not start a run (no login, a refused key): one line naming
            ``--wandb-project`` and what to do; nothing of TensorBoard written yet.
    """
    _check_wandb_mode(wandb_mode)
    if rank != 0:
        return NullSink()
    children: list[MetricSink] = []
    # W&B first: a run that cannot start (no login) fails before TensorBoard writes a file.
    if wandb_project:
        save_dir = wandb_save_dir or (
            os.path.join(tensorboard_dir, "wandb") if tensorboard_dir else None
        )
        children.append(
            WandbSink(
                wandb_project,
                wandb_exp_name,
                save_dir,
                config,
                wandb_mode,
                wandb_resume_file,
                grouped=grouped,
            )
        )
    if tensorboard_dir:
        children.insert(
            0, TensorBoardSink(tensorboard_dir, max_queue=tensorboard_queue_size, grouped=grouped)
        )
    if not children:
        return NullSink()
    return children[0] if len(children) == 1 else FanOutSink(children)


def flag_name(field: str) -> str:
    """A config field's Megatron flag (``tensorboard_dir`` -> ``--tensorboard-dir``): how the
    probes' configs name their settings unless a path gives its own spelling."""
    return "--" + field.replace("_", "-")


def require_extra(flag: str, module: str, package: str, extra: str) -> None:
    """``flag`` needs ``module``: ``ValueError`` naming the flag and the ``pip install
    'stalwart[extra]'`` to run when it cannot be imported (checked before start-up)."""
    try:
        importlib.import_module(module)
    except Exception as exc:  # missing, or installed but broken (its own import fails)
        raise ValueError(
            f"{flag} needs the {package!r} package ({type(exc).__name__}: {exc}): "
            f"pip install 'stalwart[{extra}]'"
        ) from None


@dataclass(kw_only=True, frozen=True)
class SinkConfig:
    """Where metrics go besides the log line (Megatron's flags, one field each; all off).

    ``metrics_file``: the JSONL every log line is appended to (default ``<run dir>/metrics.jsonl``,
    what ``stalwart report`` reads). ``group_metric_tags``: ``<group>/<key>`` TensorBoard/W&B
    tags instead of Megatron's flat keys. ``wandb_mode`` is a :class:`WandbMode` from
    construction on (a string is converted once, here, naming ``--wandb-mode`` on anything else).
    """

    metrics_file: str | None = None
    tensorboard_dir: str | None = None
    tensorboard_queue_size: int = 1000
    group_metric_tags: bool = False
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    wandb_mode: WandbMode | None = None

    def __post_init__(self) -> None:
        if self.wandb_mode is not None and not isinstance(self.wandb_mode, WandbMode):
            try:
                object.__setattr__(self, "wandb_mode", WandbMode(self.wandb_mode))
            except ValueError:
                allowed = ", ".join(m.value for m in WandbMode)
                raise ValueError(
                    f"--wandb-mode: got {self.wandb_mode!r}, allowed: {allowed}"
                ) from None
        queue = self.tensorboard_queue_size
        if isinstance(queue, bool) or not isinstance(queue, int) or queue < 1:
            raise ValueError(f"--tensorboard-queue-size must be an integer >= 1, got {queue!r}")

    def check_extras(self, spell: Callable[[str], str] = flag_name) -> None:
        """The back-ends' packages are importable (``ValueError`` naming the setting as
        ``spell`` writes a field's name: the flag by default)."""
        if self.tensorboard_dir is not None:
            require_extra(
                spell("tensorboard_dir"), "torch.utils.tensorboard", "tensorboard", "tensorboard"
            )
        if self.wandb_project is not None:
            require_extra(spell("wandb_project"), "wandb", "wandb", "wandb")

    def metrics_path(self, run_dir: str | None) -> str | None:
        """``metrics_file``, else ``<run dir>/metrics.jsonl``, else None."""
        if self.metrics_file:
            return self.metrics_file
        return os.path.join(run_dir, "metrics.jsonl") if run_dir else None

    def build(
        self, *, rank: int, run_dir: str | None, config: Mapping[str, Any] | None = None
    ) -> MetricSink:
        """This rank's sink; a W&B run resumes from ``<run dir>/wandb_run_id.txt``."""
        return build_sinks(
            rank=rank,
            tensorboard_dir=self.tensorboard_dir,
            tensorboard_queue_size=self.tensorboard_queue_size,
            wandb_project=self.wandb_project,
            wandb_exp_name=self.wandb_exp_name,
            wandb_save_dir=self.wandb_save_dir,
            wandb_mode=self.wandb_mode,
            wandb_resume_file=os.path.join(run_dir, "wandb_run_id.txt") if run_dir else None,
            config=config,
            grouped=self.group_metric_tags,
        )
