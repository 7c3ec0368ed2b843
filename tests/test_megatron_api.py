"""Megatron-LM's public names that stalwart keeps are API: each one pinned here, by name and by
signature, so that removing one or changing its calls incompatibly fails this test.

What is pinned (README.md, docs/migration-megatron.md and the modules' docstrings say stalwart
keeps it): the Timers API (``Timers``, ``Timer``; Megatron's ``DummyTimer`` is our
``NullTimer``), the rerun state machine's public API (the machine, its enums, exit codes, data
iterator, error injector, determinism statistics), the exit-signal handler and the enums of the
flags that take Megatron's values.

Compatible: a new optional parameter after the pinned ones, a new keyword-only parameter with a
default, a default on a parameter that had none, a new enum member. Anything else fails.

Where stalwart's surface deliberately differs from Megatron's (the pin keeps stalwart's form):
no module-level singleton (``get_rerun_state_machine`` and friends: the machine is an instance
passed to the loop); ``RerunStateMachine``'s keyword arguments have Megatron's names but not its
positional order; ``Timers.log`` returns the text (rank 0) instead of logging it on a ``rank``;
``DistributedSignalHandler.signals_received`` returns the agreed bool, not the per-rank list;
the machine's and the iterator's ``state_dict`` take no arguments; ``Timers`` takes a
``TimingLogOption``, not Megatron's string (a string is a ``TypeError`` that names the fix).
"""

from __future__ import annotations

import enum
import importlib
import inspect
import math
import signal
from collections.abc import Callable
from typing import Any

import pytest

from stalwart.observability.timers import Timers, TimingLogOption, TimingMode
from stalwart.reliability.rerun import RerunDiagnostic, RerunMode, RerunStateMachine

# "module:qualified.name" -> Megatron's call form of it, as a lambda's parameter list. A method
# is inspected on an instance (``_INSTANCES``), so ``self`` is not listed.
SIGNATURES: dict[str, str] = {
    # Timers (megatron/core/timers.py)
    "stalwart.observability.timers:Timers": (
        "log_level=0, log_option=TimingLogOption.MINMAX, mode=TimingMode.SYNC, device=None,"
        " group=None"
    ),
    "stalwart.observability.timers:Timers.__call__": "name, log_level=None",
    "stalwart.observability.timers:Timers.log": (
        "names=None, normalizer=1.0, reset=True, barrier=False"
    ),
    "stalwart.observability.timers:Timers.write": (
        "names, writer, iteration, normalizer=1.0, reset=True, barrier=False"
    ),
    "stalwart.observability.timers:Timer.start": "barrier=False",
    "stalwart.observability.timers:Timer.stop": "barrier=False",
    "stalwart.observability.timers:Timer.reset": "",
    "stalwart.observability.timers:Timer.elapsed": "reset=True, barrier=False",
    "stalwart.observability.timers:Timer.active_time": "",
    "stalwart.observability.timers:Timer.set_barrier_group": "barrier_group",
    "stalwart.observability.timers:Timer.set_elapsed": "value",
    "stalwart.observability.timers:NullTimer.start": "barrier=False",
    "stalwart.observability.timers:NullTimer.stop": "barrier=False",
    "stalwart.observability.timers:NullTimer.reset": "",
    "stalwart.observability.timers:NullTimer.elapsed": "reset=True, barrier=False",
    "stalwart.observability.timers:NullTimer.active_time": "",
    "stalwart.observability.timers:NullTimer.set_barrier_group": "barrier_group",
    "stalwart.observability.timers:NullTimer.set_elapsed": "value",
    # The rerun state machine (megatron/core/rerun_state_machine.py)
    "stalwart.reliability.rerun:RerunStateMachine": (
        "mode=RerunMode.DISABLED, error_injector=None, result_rejected_tracker_filename=None,"
        " state_save_func=None, state_restore_func=None"
    ),
    "stalwart.reliability.rerun:RerunStateMachine.should_run_forward_backward": (
        "data_iterator=None"
    ),
    "stalwart.reliability.rerun:RerunStateMachine.should_checkpoint_and_exit": "",
    "stalwart.reliability.rerun:RerunStateMachine.validate_result": (
        "result, rejection_func, message, comparison_func=None, tolerance=0.0, fatal=True"
    ),
    "stalwart.reliability.rerun:RerunStateMachine.is_unexpectedly_large": (
        "result, threshold, context, num_samples=100, resample=False"
    ),
    "stalwart.reliability.rerun:RerunStateMachine.get_mode": "",
    "stalwart.reliability.rerun:RerunStateMachine.set_mode": "mode",
    "stalwart.reliability.rerun:RerunStateMachine.state_dict": "",
    "stalwart.reliability.rerun:RerunStateMachine.load_state_dict": "sd",
    "stalwart.reliability.rerun:RerunDataIterator": "iterable",
    "stalwart.reliability.rerun:RerunDataIterator.__next__": "",
    "stalwart.reliability.rerun:RerunDataIterator.rewind": "",
    "stalwart.reliability.rerun:RerunDataIterator.advance": "",
    "stalwart.reliability.rerun:RerunDataIterator.state_dict": "",
    "stalwart.reliability.rerun:RerunDataIterator.load_state_dict": "state",
    "stalwart.reliability.rerun:RerunErrorInjector": (
        "error_injection_rate=0, error_injection_type=RerunDiagnostic.TRANSIENT_ERROR"
    ),
    "stalwart.reliability.rerun:QuickStats": "max_size=100000",
    "stalwart.reliability.rerun:QuickStats.record": "x",
    "stalwart.reliability.rerun:QuickStats.combine": "others",
    "stalwart.reliability.rerun:QuickStats.reset": "",
    "stalwart.reliability.rerun:QuickStats.print_stats": "",
    "stalwart.reliability.rerun:compare_floats": "a, b",
    # The exit-signal handler (megatron/training/dist_signal_handler.py)
    "stalwart.reliability.signals:DistributedSignalHandler": "sig=signal.SIGTERM",
    "stalwart.reliability.signals:DistributedSignalHandler.__enter__": "",
    "stalwart.reliability.signals:DistributedSignalHandler.__exit__": "*exc",
    "stalwart.reliability.signals:DistributedSignalHandler.release": "",
    "stalwart.reliability.signals:DistributedSignalHandler.signals_received": "group=None",
}

# "module:Enum" -> {member: value} that Megatron's flags, files and logs use.
ENUMS: dict[str, dict[str, object]] = {
    "stalwart.reliability.rerun:RerunMode": {
        "DISABLED": "disabled",
        "VALIDATE_RESULTS": "validate_results",
        "REPORT_DETERMINISM_STATS": "report_determinism_stats",
    },
    "stalwart.reliability.rerun:RerunDiagnostic": {
        "CORRECT_RESULT": "correct_result",
        "TRANSIENT_ERROR": "transient_error",
        "PERSISTENT_ERROR": "persistent_error",
    },
    "stalwart.reliability.rerun:RerunState": {
        "NOT_RUNNING_YET": 0,
        "INITIAL_RUN": 1,
        "RERUNNING_IN_PLACE": 2,
        "WILL_RERUN_FROM_CHECKPOINT": 3,
        "RERUNNING_FROM_CHECKPOINT": 4,
        "RERUNNING_AGAIN_FROM_CHECKPOINT": 5,
    },
    "stalwart.reliability.rerun.types:RerunValidationStatus": {
        name.upper(): name
        for name in (
            "rerun_disabled",
            "initial_run",
            "first_rerun_not_reproducible",
            "first_rerun_reproducible",
            "second_rerun_not_reproducible",
            "second_rerun_reproducible",
        )
    },
    "stalwart.observability.timers:TimingLogOption": {
        "MAX": "max",
        "MINMAX": "minmax",
        "ALL": "all",
    },
    "stalwart.config.training:LRDecayStyle": {
        "CONSTANT": "constant",
        "LINEAR": "linear",
        "COSINE": "cosine",
    },
    "stalwart.models.config:PositionEmbeddingType": {
        "LEARNED_ABSOLUTE": "learned_absolute",
        "ROPE": "rope",
    },
    "stalwart.models.config:Normalization": {"LAYER_NORM": "LayerNorm", "RMS_NORM": "RMSNorm"},
    "stalwart.models.config:RecomputeGranularity": {"SELECTIVE": "selective", "FULL": "full"},
    "stalwart.models.config:RecomputeMethod": {"UNIFORM": "uniform", "BLOCK": "block"},
    "stalwart.graphs.checks:CudaGraphImpl": {
        "NONE": "none",
        "LOCAL": "local",
        "TRANSFORMER_ENGINE": "transformer_engine",
        "FULL_ITERATION": "full_iteration",
    },
    "stalwart.reliability.inprocess.config:RestartGranularity": {"NODE": "node", "RANK": "rank"},
}

# "module:name" -> its value (exit codes, comparison results, reporting interval).
CONSTANTS: dict[str, object] = {
    "stalwart.reliability.rerun:EXIT_CODE_RESUME_TO_DISAMBIGUATE": 16,
    "stalwart.reliability.rerun:EXIT_CODE_FAILED_ON_RESULT_VALIDATION": 17,
    "stalwart.reliability.rerun.types:COMPARISON_MATCH": 0.0,
    "stalwart.reliability.rerun.types:COMPARISON_MISMATCH": math.inf,
    "stalwart.reliability.rerun:RerunStateMachine.REPORTING_INTERVAL_ITERATIONS": 2,
}


def _instances() -> dict[str, Callable[[], Any]]:
    """Class -> a cheap instance (methods are inspected bound: some are the parts' methods)."""
    from stalwart.reliability.rerun import QuickStats, RerunDataIterator
    from stalwart.reliability.signals import DistributedSignalHandler

    timers = Timers(2, TimingLogOption.MINMAX)
    return {
        "Timers": lambda: timers,
        "Timer": lambda: timers("forward-backward", 0),
        "NullTimer": lambda: Timers(0)("optimizer", 2),
        "RerunStateMachine": RerunStateMachine,
        "RerunDataIterator": lambda: RerunDataIterator(iter([1, 2])),
        "QuickStats": QuickStats,
        "DistributedSignalHandler": DistributedSignalHandler,
    }


def _resolve(target: str) -> Any:
    """The object ``target`` names (a method: bound to a fresh instance)."""
    module_name, _, path = target.partition(":")
    obj: Any = importlib.import_module(module_name)
    parts = path.split(".")
    if len(parts) == 2 and parts[0] in _instances():
        owner = _instances()[parts[0]]()
        assert hasattr(owner, parts[1]), f"{target} is gone"
        return getattr(owner, parts[1])
    for part in parts:
        assert hasattr(obj, part), f"{target} is gone"
        obj = getattr(obj, part)
    return obj


def _expected(params: str) -> inspect.Signature:
    namespace = {
        "TimingLogOption": TimingLogOption,
        "TimingMode": TimingMode,
        "RerunMode": RerunMode,
        "RerunDiagnostic": RerunDiagnostic,
        "signal": signal,
    }
    # The table above is this file's own text: a lambda turns its parameter lists into signatures.
    return inspect.signature(eval(f"lambda {params}: None", namespace))


_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)


def incompatibilities(expected: inspect.Signature, actual: inspect.Signature) -> list[str]:
    """Why a call written for ``expected`` may fail or change meaning against ``actual`` ([]:
    every such call still works)."""
    problems = []
    actual_params = actual.parameters
    actual_positional = [p for p in actual_params.values() if p.kind in _POSITIONAL]
    index = 0
    for name, want in expected.parameters.items():
        got = actual_params.get(name)
        if want.kind in _VARIADIC:
            if got is None or got.kind is not want.kind:
                problems.append(f"{want} is no longer accepted")
            continue
        if want.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD:
            at = actual_positional[index] if index < len(actual_positional) else None
            if at is None or at.name != name:
                shown = "nothing" if at is None else repr(at.name)
                problems.append(f"positional parameter {index} is {shown}, not {name!r}")
            index += 1
        if got is None:
            problems.append(f"parameter {name!r} is gone")
            continue
        if got.kind is inspect.Parameter.POSITIONAL_ONLY:
            problems.append(f"{name!r} can no longer be passed by keyword")
        if want.default is not inspect.Parameter.empty and got.default != want.default:
            problems.append(f"{name!r} defaults to {got.default!r}, not {want.default!r}")
    for name, got in actual_params.items():
        required = got.default is inspect.Parameter.empty and got.kind not in _VARIADIC
        if name not in expected.parameters and required:
            problems.append(f"new required parameter {name!r}")
    return problems


@pytest.mark.parametrize("target", sorted(SIGNATURES))
def test_megatron_call_forms_still_work(target: str) -> None:
    obj = _resolve(target)
    assert callable(obj), f"{target} is not callable"
    actual = inspect.signature(obj)  # a class: its constructor, without self
    problems = incompatibilities(_expected(SIGNATURES[target]), actual)
    assert not problems, f"{target}{actual}: " + "; ".join(problems)


@pytest.mark.parametrize("target", sorted(ENUMS))
def test_megatron_enum_values_are_kept(target: str) -> None:
    cls = _resolve(target)
    assert issubclass(cls, enum.Enum), f"{target} is no longer an enum"
    for name, value in ENUMS[target].items():
        assert name in cls.__members__, f"{target}.{name} is gone"
        assert cls[name].value == value, f"{target}.{name} = {cls[name].value!r}, not {value!r}"
        assert cls(value) is cls[name]  # parsed from Megatron's spelling


@pytest.mark.parametrize("target", sorted(CONSTANTS))
def test_megatron_constants_are_kept(target: str) -> None:
    value = _resolve(target)
    assert value == CONSTANTS[target], f"{target} = {value!r}, not {CONSTANTS[target]!r}"


def test_the_checker_catches_incompatible_changes() -> None:
    """The pin is only as good as its checker: each kind of break is caught, each compatible
    change is not."""
    pinned = _expected("names, writer, normalizer=1.0, reset=True")

    def sig(params: str) -> inspect.Signature:
        return _expected(params)

    compatible = [
        "names, writer, normalizer=1.0, reset=True",
        "names, writer, normalizer=1.0, reset=True, barrier=False",  # a new optional parameter
        "names, writer=None, normalizer=1.0, reset=True",  # a default added
        "names, writer, normalizer=1.0, reset=True, *, extra=3",
        "names, writer, normalizer=1.0, reset=True, **kwargs",
    ]
    for params in compatible:
        assert incompatibilities(pinned, sig(params)) == [], params
    broken = {
        "names, normalizer=1.0, reset=True": "gone",  # removed
        "names, writer, reset=True, normalizer=1.0": "positional parameter 2",  # reordered
        "names, sink, normalizer=1.0, reset=True": "gone",  # renamed
        "names, writer, normalizer=2.0, reset=True": "defaults to 2.0",
        "names, writer, normalizer=1.0, reset=True, *, needed": "new required",
        "names, writer, /, normalizer=1.0, reset=True": "by keyword",
    }
    for params, why in broken.items():
        found = incompatibilities(pinned, sig(params))
        assert any(why in problem for problem in found), (params, found)


def test_set_barrier_group_is_the_group_a_timer_barriers_with() -> None:
    """``Timer.set_barrier_group(group)`` (Megatron's API) sets the group that ``barrier=True``
    waits for on start, stop and elapsed."""
    from stalwart.distributed import collectives

    seen: list[object] = []
    timer = Timers(2, TimingLogOption.MINMAX)("forward-backward", 0)
    group = object()  # a process group stands in: only its identity is passed on
    timer.set_barrier_group(group)  # type: ignore[arg-type]
    original = collectives.barrier
    collectives.barrier = lambda g=None: seen.append(g)  # type: ignore[assignment]
    try:
        timer.start(barrier=True)
        timer.elapsed(barrier=True)  # stop and restart: two barriers
        timer.stop(barrier=True)
        timer.start()  # no barrier asked: none
        timer.stop()
    finally:
        collectives.barrier = original
    assert seen == [group] * 4
    timer.set_elapsed(2.5)
    assert timer.elapsed() == 2.5 and timer.elapsed() == 0.0  # read and reset, as Megatron
    null = Timers(0)("optimizer", 2)
    null.set_barrier_group(group)  # type: ignore[arg-type]  # a disabled timer: nothing happens
    null.set_elapsed(1.0)


def test_set_mode_changes_the_mode_between_iterations_only() -> None:
    """Megatron's evaluation switches the machine off and back (``get_mode``/``set_mode``)."""
    from stalwart.reliability.rerun import RerunDataIterator

    machine = RerunStateMachine(RerunMode.VALIDATE_RESULTS)
    machine.set_mode(RerunMode.DISABLED)
    assert machine.get_mode() is RerunMode.DISABLED
    machine.set_mode("validate_results")
    assert machine.get_mode() is RerunMode.VALIDATE_RESULTS
    data = RerunDataIterator(iter(range(10)))
    assert machine.should_run_forward_backward(data, iteration=0)
    with pytest.raises(RuntimeError, match="between iterations only"):
        machine.set_mode(RerunMode.DISABLED)  # inside the iteration's pass
    assert machine.get_mode() is RerunMode.VALIDATE_RESULTS
    with pytest.raises(ValueError, match="--rerun-mode"):
        machine.set_mode("sometimes")


def test_the_signal_handler_keeps_megatrons_protocol() -> None:
    from stalwart.reliability.signals import DistributedSignalHandler

    before = signal.getsignal(signal.SIGUSR2)
    with DistributedSignalHandler(signal.SIGUSR2) as handler:
        assert handler.signals_received() is False
        signal.raise_signal(signal.SIGUSR2)
        assert handler.signals_received() is True
    assert signal.getsignal(signal.SIGUSR2) == before  # restored on exit
    assert handler.release() is False  # once only
