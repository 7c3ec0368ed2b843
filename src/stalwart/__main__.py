"""`python -m stalwart ...` (so that `torchrun ... -m stalwart train` works), and the ``stalwart``
console script (`run`)."""

import gc
import sys

from stalwart.cli.closed_pipe import ClosedPipeSafeStream
from stalwart.cli.main import main


def run() -> int:
    """`stalwart.cli.main.main` as a whole process: the exit code, then a cheap interpreter exit.

    A trainer process holds ~300k objects from torch's import graph (torch._dynamo, which DDP
    imports, and sympy); the interpreter's shutdown walks them for cycles several times: ~1.3 s
    of CPU per process, in every rank of every launch. One collection now finalises the job's
    own cyclic garbage (files, handles: nothing is left for the shutdown to find), then
    ``gc.freeze()`` moves what is left out of the collector's sight; the atexit handlers still
    run and what they free is still collected.

    Standard output and error survive a reader that went away (`ClosedPipeSafeStream`): every
    command ends with its own exit code, without a ``BrokenPipeError`` traceback.
    """
    sys.stdout = ClosedPipeSafeStream(sys.stdout)  # type: ignore[assignment]
    sys.stderr = ClosedPipeSafeStream(sys.stderr)  # `2>&1 | head`: the error line, the logs
    code = main()
    sys.stdout.flush()  # a closed pipe is met here, not in the interpreter's final flush
    sys.stderr.flush()
    gc.collect()
    gc.freeze()
    return code


if __name__ == "__main__":
    raise SystemExit(run())
