"""The goodput ledger: where every wall-clock second of a job went, across restarts and relaunches.

* `ledger`: :class:`GoodputLedger` (the cursor over buckets, what a session writes),
  :class:`NullGoodputLedger`, ``record_action`` (``stalwart launch``'s records).
* `records`: the file's records, buckets and the summary of a job.
* `reader`: ``read_ledger``, the one place a line of ``goodput.jsonl`` becomes a record.
* `held`: what waits for a step's end or for the look-ahead's next step.
* `session`: process start times and what earlier sessions left.
* `recovery`: each recovery from a fault (detection, teardown, restart, recompile, lost work).
* `ettr`: ETTR at N GPUs from those costs under a failure model (pure functions);
  `ettr_report`: ``stalwart goodput --project``.

Standard library only: ``stalwart goodput`` reads the ledger without torch.
"""

from stalwart.observability.goodput.ledger import (
    GoodputLedger,
    NullGoodputLedger,
    make_goodput_ledger,
    record_action,
    straggler_idle_seconds,
)
from stalwart.observability.goodput.records import GOODPUT_FILE, Bucket, CompileSource
from stalwart.observability.goodput.session import process_start_time

__all__ = [
    "GOODPUT_FILE",
    "Bucket",
    "CompileSource",
    "GoodputLedger",
    "NullGoodputLedger",
    "make_goodput_ledger",
    "process_start_time",
    "record_action",
    "straggler_idle_seconds",
]
