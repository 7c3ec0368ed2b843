"""``python -m stalwart.distributed.torchrun ARGS``: torchrun (``python -m torch.distributed.run
ARGS``) with a cheap interpreter exit.

The same launcher, arguments, signals and exit codes: only its last step changes. A torchrun
agent holds torch's whole import graph, which the interpreter's shutdown walks for cycles
(~1 s of CPU per launch); as `stalwart.__main__.run` does for the workers, one collection
finalises the agent's own garbage, then ``gc.freeze()`` hides the rest from the shutdown's
passes. ``stalwart chaos`` and the test suite launch many short jobs through it.
"""

from __future__ import annotations

import gc
import runpy


def main() -> None:
    try:
        runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
    finally:
        gc.collect()
        gc.freeze()


if __name__ == "__main__":
    main()
