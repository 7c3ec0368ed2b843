"""The parts a :class:`~stalwart.loop.Shell` is made of, built once from its config: the
reliability parts (goodput ledger, hang sections, signal handler, iteration agreement, rerun
machine, replica check) and the probes (timers, sinks, stragglers, memory, energy, save timing,
memory release, profiler window, ``progress.txt``). Each part closes through the shell's exit
stack; a part that is off is its null object.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from stalwart.loop.observer import StepObserver
from stalwart.loop.rewind import Rewinder
from stalwart.loop.shell_settings import ShellSettings
from stalwart.observability.dumps import NullTensorDumper
from stalwart.observability.goodput import GOODPUT_FILE, make_goodput_ledger
from stalwart.observability.save_timing import SaveTiming
from stalwart.observability.straggler import StragglerIdle
from stalwart.reliability.hang.sections import build_section_monitor
from stalwart.reliability.rerun import RerunConfig
from stalwart.reliability.rewind import RewindPolicy, read_rewinds

logger = logging.getLogger("stalwart.loop.shell")


def _flushed(say: Callable[[str], None], line: str) -> None:
    say(line)
    sys.stdout.flush()


@dataclass
class Reliability:
    """The ledger, the watchdog's sections, the signal handler (not installed yet), the
    agreement, the rerun machine (with the replica check) and the spike rewinds."""

    ledger: Any
    sections: Any
    signal_handler: Any
    agreement: Any
    machine: Any
    rewinder: Rewinder

    @classmethod
    def build(
        cls,
        config: ShellSettings,
        *,
        rank: int,
        device: torch.device,
        attempt: int,
        loss_scaler: Any,
        say: Callable[[str], None],
        stack: contextlib.ExitStack,
        started: float,
    ) -> Reliability:
        run_dir = config.artefact_dir
        try:
            ledger = make_goodput_ledger(
                config.goodput,
                run_dir,
                rank=rank,
                attempt=attempt,
                print_fn=functools.partial(_flushed, say),
            )
        except OSError as exc:
            raise ValueError(f"{run_dir}: cannot write the goodput ledger ({exc})") from None
        stack.callback(ledger.close, "fault", "the shell closed without an exit")
        goodput_file = os.path.join(run_dir, GOODPUT_FILE) if run_dir else None
        sections = build_section_monitor(
            config.ft, rank, config.save_dir, goodput_file=goodput_file
        )
        stack.callback(sections.close)
        handler = config.exit.make_signal_handler() if config.exit.handles_signals else None
        agreement = config.exit.build(handler, started)
        scaler = (
            {}
            if loss_scaler is None
            else {
                "state_save_func": loss_scaler.state_dict,
                "state_restore_func": loss_scaler.load_state_dict,
            }
        )
        rewinds = rewind_policy(config.rerun)
        machine = config.rerun.build(
            device,
            agreement=agreement,
            marker_dir=config.save_dir,
            rewind=rewinds.allows,
            **scaler,
        )
        return cls(ledger, sections, handler, agreement, machine, Rewinder(rewinds))


def rewind_policy(config: RerunConfig) -> RewindPolicy:
    """The spike rewinds of ``config``, with those its tracker file records (earlier launches
    of the run count against ``max_rewinds`` and scale the learning rate alike)."""
    tracker = config.result_rejected_tracker_filename
    on = config.rewind_on_spike
    return RewindPolicy(
        enabled=on,
        window=config.rewind_skip_window,
        lr_scale=config.rewind_lr_scale,
        max_rewinds=config.max_rewinds,
        records=read_rewinds(tracker) if on and tracker else (),
    )


@dataclass
class Probes:
    """Timers, the sinks (built first by the shell), stragglers, memory, energy, save timing, the
    memory release, the profiler window, ``progress.txt`` and the step's observer (no dumps until a
    step exists); ``providers``: what the training log's line shows besides its own fields."""

    timers: Any
    sink: Any
    straggler: Any
    memory: Any
    energy: Any
    saves: SaveTiming
    memory_release: Any
    profiler: Any
    progress: Any
    observer: StepObserver
    providers: list[Any]

    @classmethod
    def build(
        cls,
        config: ShellSettings,
        *,
        rank: int,
        world_size: int,
        device: torch.device,
        ledger: Any,
        sink: Any,
        estimate: Any,
        say: Callable[[str], None],
        stack: contextlib.ExitStack,
    ) -> Probes:
        run_dir, on_close = config.artefact_dir, stack.callback
        timers = config.timers.build(device)
        straggler = config.straggler.build(device, rank, world_size, run_dir)
        on_close(straggler.close)
        memory = config.memory.build(
            device,
            estimate,
            run_dir=run_dir,
            rank=rank,
            log_interval=config.log.log_interval,
            sink=sink,
            log=say,
        )
        energy = config.energy.build(device, log=say)
        on_close(energy.close)
        saves = SaveTiming(timers, ledger=ledger)
        release = config.memory_release.build(device)
        profiler = config.profiler.build(
            rank=rank, world_size=world_size, device=device, run_dir=run_dir
        )
        on_close(profiler.close)
        progress = config.progress.build(config.save_dir, world_size, rank)
        observer = StepObserver(straggler, NullTensorDumper(), release)
        providers = [
            straggler,
            memory,
            energy,
            StragglerIdle(straggler, ledger),
            saves,
            ledger,
        ]
        return cls(
            timers,
            sink,
            straggler,
            memory,
            energy,
            saves,
            release,
            profiler,
            progress,
            observer,
            providers,
        )


__all__ = ["Probes", "Reliability", "rewind_policy"]
