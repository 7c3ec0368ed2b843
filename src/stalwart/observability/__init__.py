"""Observability: timers, training log, metric sinks (TensorBoard / W&B / JSONL), progress bar.

Each owner keeps their re-exports in their own block below; add new blocks, do not reorder.
"""

# --- timers, sinks, training log, progress (owner: timers/train_log engineer) ---
from stalwart.observability.progress import ProgressBar
from stalwart.observability.sinks import (
    FanOutSink,
    JsonlSink,
    MetricSink,
    NullSink,
    TensorBoardSink,
    WandbSink,
    build_sinks,
    is_null_sink,
)
from stalwart.observability.timers import (
    INTERVAL_TIME,
    STANDARD_TIMER_LEVELS,
    TRAINING_TIMERS,
    NullTimer,
    Timer,
    TimerReport,
    Timers,
    TimingMode,
    validate_timing_flags,
)
from stalwart.observability.train_log import (
    IntervalInfo,
    IntervalSummary,
    LogConfig,
    LogField,
    LogFieldProvider,
    TrainingLog,
    format_iteration_line,
    format_validation_lines,
)

# --- straggler / memory / energy / dumps / report (owner: other engineer): add imports here ---

__all__ = [
    "INTERVAL_TIME",
    "STANDARD_TIMER_LEVELS",
    "TRAINING_TIMERS",
    "FanOutSink",
    "IntervalInfo",
    "IntervalSummary",
    "JsonlSink",
    "LogConfig",
    "LogField",
    "LogFieldProvider",
    "MetricSink",
    "NullSink",
    "NullTimer",
    "ProgressBar",
    "TensorBoardSink",
    "Timer",
    "TimerReport",
    "Timers",
    "TimingMode",
    "TrainingLog",
    "WandbSink",
    "build_sinks",
    "format_iteration_line",
    "format_validation_lines",
    "is_null_sink",
    "validate_timing_flags",
]
