"""The timeout hierarchy of hang handling, checked once at start-up (pure, no side effects).

A hang meets, from the cheapest recovery to the bluntest:

1. in-process restart's soft timeout (``--inprocess-soft-timeout``): interrupt, restart in place;
2. the hang watchdog's section timeouts (``--ft-timeouts``), which escalate in tiers: *soft*
   (stack dump of every thread and the NCCL flight recorder, into the run directory), *hard*
   (abort the process group, so peers blocked in a collective return), then *kill* (the launcher
   restarts the job);
3. the process-group timeout (``--distributed-timeout-minutes``): a collective fails on its own,
   without any dump.

A set-up in which a tier can never fire before the next one is refused in one line
(``ValueError`` naming the flags): its diagnostics or its cheaper recovery would silently never
happen. Only the sections whose hangs are collective waits (``step``, ``checkpointing``) are held
against the process-group timeout; ``setup`` covers model build and data indexing too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Escalation:
    """Seconds between the watchdog's tiers after a timeout is detected.

    ``poll_s``: detection latency (the monitor's polling period); ``dump_wait_s``: the soft
    tier's wait for the stack dump; ``abort_grace_s``: after the hard tier's abort, how long the
    rank may take to exit by itself; ``kill_grace_s``: SIGTERM to SIGKILL.
    """

    poll_s: float = 1.0
    dump_wait_s: float = 1.0
    abort_grace_s: float = 2.0
    kill_grace_s: float = 0.0

    @property
    def total_s(self) -> float:
        """From a section's timeout to the rank being gone, at worst."""
        return self.poll_s + self.dump_wait_s + self.abort_grace_s + self.kill_grace_s


def check_timeout_hierarchy(
    *,
    step_s: float | None,
    checkpointing_s: float | None,
    escalation: Escalation,
    process_group_timeout_s: float | None,
    inprocess_soft_timeout_s: float | None = None,
) -> None:
    """Raise ``ValueError`` (one line, naming the flags) when a lower tier can never fire first.

    ``None`` means the tier is off (no ``--enable-ft``, no in-process restart, no process group).
    """
    if process_group_timeout_s is not None:
        for name, section_s in (("step", step_s), ("checkpointing", checkpointing_s)):
            if section_s is not None and section_s + escalation.total_s >= process_group_timeout_s:
                raise ValueError(
                    f"--ft-timeouts {name}={section_s:g} plus {escalation.total_s:g} s of "
                    f"detection, stack dump and abort is not below --distributed-timeout-minutes "
                    f"({process_group_timeout_s / 60:g} min = {process_group_timeout_s:g} s): a "
                    "collective hang would fail on the process-group timeout before the hang "
                    f"watchdog dumps anything; lower --ft-timeouts {name} or raise "
                    "--distributed-timeout-minutes"
                )
    soft = inprocess_soft_timeout_s
    if soft is not None and step_s is not None and soft >= step_s:
        raise ValueError(
            f"--inprocess-soft-timeout {soft:g} is not below --ft-timeouts step={step_s:g}: the "
            "hang watchdog would kill a hung rank before in-process restart could recover it in "
            "place; lower --inprocess-soft-timeout or raise --ft-timeouts step"
        )
