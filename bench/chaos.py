"""Chaos campaign: every fault kind once against the reference trainer (2 CPU ranks, gloo).

    python bench/chaos.py --json runs/chaos.json          # what `make chaos` runs
    python bench/chaos.py --faults hang,sigkill --seed 3  # a subset, another schedule

Same flags as ``stalwart chaos`` (see ``stalwart chaos --help`` and docs/reliability.md); exit 0
only when every fault behaved as documented.
"""

from __future__ import annotations

import sys

from stalwart.cli.chaos import main_chaos

if __name__ == "__main__":
    raise SystemExit(main_chaos(sys.argv[1:]))
