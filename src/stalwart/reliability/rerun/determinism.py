"""Determinism statistics (``report_determinism_stats`` mode): every pass runs twice and the
relative difference of each validation call between the two runs is collected and reported."""

from __future__ import annotations

import logging

from stalwart.distributed import collectives
from stalwart.reliability.rerun.checks.rules import evaluate_comparison
from stalwart.reliability.rerun.checks.stats import QuickStats
from stalwart.reliability.rerun.reporter import Reporter
from stalwart.reliability.rerun.types import CallKey
from stalwart.reliability.rerun.verdicts import Items

# The report keeps the machine's logger name (log parsers).
logger = logging.getLogger("stalwart.reliability.rerun.machine")


class DeterminismStats:
    """The statistics per validation call (message) and the initial run's values.

    Args:
        reporter: the machine's place in its group (the report is gathered to rank 0).
        interval: report every ``interval`` iterations.
    """

    def __init__(self, reporter: Reporter, interval: int) -> None:
        self._reporter = reporter
        self.interval = interval
        self.stats: dict[str, QuickStats] = {}
        self.last_report: str | None = None
        self._initial: dict[CallKey, float] = {}

    def keep_initial(self, items: Items) -> None:
        """The initial run's values, compared with the rerun's by :meth:`record`."""
        self._initial = {rec.key: v for rec, v in items}

    def record(self, items: Items, iteration: int) -> None:
        """The rerun's values: one difference per call; the report when it is due
        (collective: every rank of the group calls it at the same iterations)."""
        for rec, v in items:
            initial = self._initial.get(rec.key)
            if initial is None:
                raise RuntimeError(f"Result from the initial run missing for {rec.key}")
            diff = evaluate_comparison(rec.spec.comparison_func, initial, v)
            self.stats.setdefault(rec.spec.message, QuickStats()).record(diff)
        self._initial = {}
        if iteration % self.interval == 0:
            self._report()

    def _report(self) -> None:
        gathered = collectives.all_gather_objects(self.stats, self._reporter.process_group)
        if self._reporter.group_rank != 0:
            self.stats = {}
            return
        for other in gathered[1:]:
            for message, qs in other.items():  # type: ignore[attr-defined]
                self.stats.setdefault(message, QuickStats()).combine([qs])
        self.last_report = self.report()
        logger.warning(self.last_report)

    def report(self) -> str:
        """Percentiles of the relative difference between the two runs, per validation call."""
        lines = ["Stats on computation determinism in validation calls"]
        for message, qs in sorted(self.stats.items()):
            lines.append(f"  From validation call '{message}': {qs.print_stats()}")
        return "\n".join(lines)
