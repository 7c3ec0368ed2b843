"""Observability: timers, training log, metric sinks (TensorBoard / W&B / JSONL), progress bar,
stragglers, theoretical vs measured memory, energy and tensor dumps (the offline run report is
`stalwart.report`).

Every part works on its own in a hand-written loop (see each module's docstring).
"""

from stalwart.observability.dumps import (
    DumpConfig,
    NullTensorDumper,
    TensorDumper,
    make_tensor_dumper,
)
from stalwart.observability.energy import EnergyConfig, EnergyMeter, NullEnergyMeter
from stalwart.observability.memory import (
    MemoryFootprint,
    MemoryMonitor,
    NullMemoryMonitor,
    measured_memory,
)
from stalwart.observability.memory_release import (
    MemoryReleaseConfig,
    NullMemoryRelease,
    UnusedMemoryRelease,
)
from stalwart.observability.metric_names import grouped_name
from stalwart.observability.progress import ProgressBar
from stalwart.observability.run_dir import EventKind, RunPaths, append_event
from stalwart.observability.sinks import (
    FanOutSink,
    JsonlSink,
    MetricSink,
    NullSink,
    TensorBoardSink,
    WandbMode,
    WandbSink,
    build_sinks,
    is_null_sink,
)
from stalwart.observability.straggler import (
    NullStragglerDetector,
    StragglerConfig,
    StragglerDetector,
    StragglerReport,
)
from stalwart.observability.timers import (
    INTERVAL_TIME,
    STANDARD_TIMER_LEVELS,
    TRAINING_TIMERS,
    NullTimer,
    Timer,
    TimerReport,
    Timers,
    TimingLogOption,
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

__all__ = [
    "INTERVAL_TIME",
    "STANDARD_TIMER_LEVELS",
    "TRAINING_TIMERS",
    "DumpConfig",
    "EnergyConfig",
    "EnergyMeter",
    "EventKind",
    "FanOutSink",
    "IntervalInfo",
    "IntervalSummary",
    "JsonlSink",
    "LogConfig",
    "LogField",
    "LogFieldProvider",
    "MemoryFootprint",
    "MemoryMonitor",
    "MemoryReleaseConfig",
    "MetricSink",
    "NullEnergyMeter",
    "NullMemoryMonitor",
    "NullMemoryRelease",
    "NullSink",
    "NullStragglerDetector",
    "NullTensorDumper",
    "NullTimer",
    "ProgressBar",
    "RunPaths",
    "StragglerConfig",
    "StragglerDetector",
    "StragglerReport",
    "TensorBoardSink",
    "TensorDumper",
    "Timer",
    "TimerReport",
    "Timers",
    "TimingLogOption",
    "TimingMode",
    "TrainingLog",
    "UnusedMemoryRelease",
    "WandbMode",
    "WandbSink",
    "append_event",
    "build_sinks",
    "format_iteration_line",
    "format_validation_lines",
    "grouped_name",
    "is_null_sink",
    "make_tensor_dumper",
    "measured_memory",
    "validate_timing_flags",
]
