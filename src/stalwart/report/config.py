"""The run's settings in the report: ``run.json``'s ``config`` as one table, and, for a
comparison of runs, the settings that differ between them.

The config is data written by the trainer (``RunConfig.to_dict()``: components as nested
objects); the report only flattens it to ``component.field`` rows and escapes every value, so a
hostile ``run.json`` shows as text, never runs::

    >>> flatten({"optim": {"lr": 0.001, "betas": [0.9, 0.95]}, "preset": "tiny"})
    {'optim.lr': '0.001', 'optim.betas': '[0.9, 0.95]', 'preset': 'tiny'}
    >>> differing([{"optim.lr": "0.001", "preset": "tiny"},
    ...            {"optim.lr": "0.002", "preset": "tiny"}])
    ['optim.lr']
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from stalwart.report.svg import _e

MAX_ROWS = 2000  # a hostile run.json could hold millions of keys
MAX_VALUE_CHARS = 300


def _text(value: Any) -> str:
    text = value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= MAX_VALUE_CHARS else text[:MAX_VALUE_CHARS] + "…"


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"component.field": "value"}`` of a nested config (lists and scalars as JSON text)."""
    out: dict[str, str] = {}
    stack: list[tuple[str, Any]] = [(prefix, config)]
    while stack and len(out) < MAX_ROWS:
        path, value = stack.pop()
        if isinstance(value, Mapping) and value:
            items = [(f"{path}.{k}" if path else str(k), v) for k, v in value.items()]
            stack.extend(reversed(items))
        else:
            out[path] = _text(value)
    return out


def differing(flat: Sequence[Mapping[str, str]]) -> list[str]:
    """Keys whose value is not the same in every run (a key one run lacks differs)."""
    keys: dict[str, None] = {}
    for f in flat:
        keys.update(dict.fromkeys(f))
    return [k for k in keys if len({f.get(k) for f in flat}) > 1]


def _table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def config_section(config: Mapping[str, Any] | None) -> str:
    """Section ``config``: every setting of the run (from ``run.json``), or a note."""
    if not config:
        body = (
            '<p class="note">run.json has no settings: the run was written by an older stalwart '
            "or by a loop that does not record them.</p>"
        )
    else:
        rows = sorted(flatten(config).items())
        body = (
            f"<details open><summary>{len(rows)} settings (run.json)</summary>"
            + _table(["setting", "value"], rows)
            + "</details>"
        )
    return f'<section id="config"><h2>Config</h2>{body}</section>'


def config_diff_section(labels: Sequence[str], configs: Sequence[Mapping[str, Any] | None]) -> str:
    """Section ``config-diff`` of a comparison: the settings that differ, one column per run."""
    flat = [flatten(c) if c else {} for c in configs]
    missing = [label for label, c in zip(labels, configs) if not c]
    keys = sorted(differing([f for f in flat if f])) if len(flat) - len(missing) > 1 else []
    body = ""
    if missing:
        body += f'<p class="note">no settings recorded (run.json) for: {_e(", ".join(missing))}</p>'
    if keys:
        rows = [[k, *(f.get(k, "(not set)") if f else "?" for f in flat)] for k in keys]
        body += _table(["setting", *labels], rows)
    elif not missing:
        body += "<p>The runs have the same settings.</p>"
    return f'<section id="config-diff"><h2>Settings that differ</h2>{body}</section>'
