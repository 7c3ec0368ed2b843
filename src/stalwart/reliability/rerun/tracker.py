"""The result-rejected tracker file (``--result-rejected-tracker-filename``).

One line per event, Megatron's format::

    ts=<datetime> node=<host> device=<id> jobID=<id> rank=<r> iteration=<i> status=<s>
    result=<v> message='<m>'

(one line in the file, wrapped here).

``iteration`` counts from 1 as in Megatron and in the training log line (the machine's 0-based
loop index + 1): the same number in every run of it and the number ``--iterations-to-skip``
takes.
"""

from __future__ import annotations

import datetime
import logging
import os
import re
from collections import defaultdict

from stalwart.reliability.rerun.types import Identity, RerunValidationStatus, job_id

logger = logging.getLogger(__name__)

_LINE = re.compile(
    r"ts=.+? node=\S+ device=\S+ jobID=(?P<job>\S+) rank=(?P<rank>-?\d{1,18}) "
    r"iteration=(?P<it>-?\d{1,18}) status=(?P<status>\S+) result=.+? message=(?P<message>.*)",
    re.ASCII,
)
_SKIP_STATUSES = frozenset(
    {
        RerunValidationStatus.RERUN_DISABLED,
        RerunValidationStatus.FIRST_RERUN_REPRODUCIBLE,
        RerunValidationStatus.SECOND_RERUN_REPRODUCIBLE,
        RerunValidationStatus.PEER_REPLAY_REPRODUCIBLE,  # the second rerun, on a peer
    }
)


_REWIND = RerunValidationStatus.REWIND_SKIPPED


def read_status_lines(tracker_path: str, status: RerunValidationStatus) -> list[tuple[int, str]]:
    """``(iteration, message as written)`` of every readable line with ``status``, in file order
    (a missing or unreadable file: ``[]``)."""
    events, _ = _read_events(tracker_path)
    return [(it, message) for _, _, it, found, message in events if found is status]


class TrackerFile:
    """Appends event lines; checks at construction that the file can be appended to
    (``ValueError`` naming ``--result-rejected-tracker-filename`` if not)."""

    def __init__(self, path: str) -> None:
        self.path = path
        if os.path.exists(path) and not os.path.isfile(path):
            raise ValueError(
                f"--result-rejected-tracker-filename {path!r} exists and is not a regular file"
            )
        try:
            with open(path, "a", encoding="utf-8"):
                pass
        except OSError as exc:
            # ValueError: bad user input (the CLI turns it into exit code 2 and one line).
            raise ValueError(
                f"--result-rejected-tracker-filename {path!r} cannot be appended to ({exc})"
            ) from exc

    def write(
        self,
        *,
        identity: Identity,
        rank: int,
        iteration: int,
        status: RerunValidationStatus,
        result: float,
        message: str,
    ) -> None:
        """Append one line for the 0-based loop index ``iteration`` (written as ``iteration + 1``);
        an I/O error is logged, never raised (the run matters more)."""
        line = (
            f"ts={datetime.datetime.now()} node={identity[0]} device={identity[1]} "
            f"jobID={job_id()} rank={rank} iteration={iteration + 1} status={status.value} "
            f"result={result!r} message={message!r}\n"
        )
        try:
            with open(self.path, "a", encoding="utf-8") as f:
                f.write(line)
        except OSError as exc:
            logger.error("Cannot append to result-rejected tracker file %s: %s", self.path, exc)


def _parse_status(text: str) -> RerunValidationStatus | None:
    name = text.split(".")[-1].lower()  # accepts "RerunValidationStatus.X" too
    try:
        return RerunValidationStatus(name)
    except ValueError:
        return None


Row = tuple[str, int, int, RerunValidationStatus | None, str]
"""One readable line: (job, rank, iteration, status, message as written)."""


def _read_events(tracker_path: str) -> tuple[list[Row], int]:
    """``(job, rank, iteration, status, message)`` of every readable line, and how many were
    not readable.

    Lines are decoded one by one: a line torn by a crash or holding foreign bytes is skipped, the
    rest of the file still counts. A missing or unreadable file yields no events.
    """
    if os.path.exists(tracker_path) and not os.path.isfile(tracker_path):
        logger.warning("Tracker file %s is not a regular file; not read", tracker_path)
        return [], 0  # a FIFO or device would block or never end
    try:
        with open(tracker_path, "rb") as f:
            raw_lines = f.read().splitlines()
    except OSError as exc:
        logger.warning("Cannot read tracker file %s: %s", tracker_path, exc)
        return [], 0
    events: list[Row] = []
    unreadable = 0
    for raw in raw_lines:
        if not raw.strip():
            continue
        try:
            m = _LINE.match(raw.decode("utf-8").strip())
        except UnicodeDecodeError:
            m = None
        if m is None:
            unreadable += 1
            continue
        row = (m["job"], int(m["rank"]), int(m["it"]), _parse_status(m["status"]), m["message"])
        events.append(row)
    return events, unreadable


def read_iterations_to_skip(tracker_path: str) -> list[int]:
    """Iterations to skip (numbered from 1, as written), derived from a tracker file.

    An iteration is skipped when the same (rank, iteration) was reported twice with a status
    meaning "the bad result is real" (``rerun_disabled``, ``first_rerun_reproducible``,
    ``second_rerun_reproducible``, ``peer_replay_reproducible``), in any jobs; it is *not*
    skipped when several ranks reported it within one job (a systemic or application problem, not
    bad data). A missing or unreadable file yields ``[]``; unreadable lines (not UTF-8, not in the
    format) are skipped, and their number is logged once. An iteration with a ``rewind_skipped``
    line (a spike rewind skipped it, ``--rewind-on-spike``) is skipped whatever else the file says.
    """
    hits: dict[tuple[int, int], int] = defaultdict(int)
    ranks_per_job: dict[tuple[str, int], set[int]] = defaultdict(set)
    events, unreadable = _read_events(tracker_path)
    if unreadable:
        logger.warning(
            "Skipped %d unreadable line(s) of tracker file %s (not UTF-8 or not in the "
            "tracker format)",
            unreadable,
            tracker_path,
        )
    rewound = {it for _, _, it, status, _ in events if status is _REWIND}
    for job, rank, it, status, _ in events:
        if status not in _SKIP_STATUSES:
            continue
        hits[(rank, it)] += 1
        ranks_per_job[(job, it)].add(rank)
    candidates = {it for (_, it), n in hits.items() if n >= 2}
    systemic = {it for (_, it), ranks in ranks_per_job.items() if len(ranks) > 1}
    skip = sorted((candidates - systemic) | rewound)
    if skip:
        logger.warning("Will skip these iterations from tracker file: %s", skip)
    if (candidates & systemic) - rewound:
        logger.warning(
            "Will not skip these iterations due to multiple rank errors: %s",
            sorted((candidates & systemic) - rewound),
        )
    return skip
