"""In-process restart needs a failed attempt's process group to be freed by its finalize: on
gloo, that is what ends the peers' pending collectives. torch.distributed.nn.functional binds
the default group alive at its import as a default argument of its collectives; imported first
by a checkpoint save (torch.distributed.checkpoint imports it), after the group exists, it held
that group forever and the surviving rank hung until its hard timeout. stalwart imports it
before any group; this checks it in a fresh interpreter (the test process has imported
everything already), together with what the lazy import buys: a trainer process that never
saves never imports torch.distributed.checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

SCRIPT = textwrap.dedent(
    """
    import gc, sys, weakref
    import torch
    import torch.distributed as dist
    import stalwart.cli.train  # the trainer's whole import graph, in-process restart included
    from stalwart.checkpoint.dcp_io import save_sync
    from stalwart.reliability.inprocess.wrapper import abort_process_groups

    assert "torch.distributed.checkpoint" not in sys.modules, "DCP imported by the trainer"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    group = weakref.ref(dist.group.WORLD)
    save_sync({"model": {"w": torch.ones(3)}}, sys.argv[1], None)  # DCP's first import
    assert "torch.distributed.checkpoint" in sys.modules
    abort_process_groups()  # the restart's abort, then its finalize's gc
    gc.collect()
    holders = [f"{f.__module__}.{f.__qualname__}" for f in gc.get_objects()
               if callable(f) and group() is not None
               and any(v is group() for v in getattr(f, "__defaults__", None) or ())]
    assert group() is None, f"the aborted group is still alive, held by {holders[:3]}"
    print("released")
    """
)


def test_aborted_group_is_freed_after_the_first_checkpoint_import(tmp_path: Path) -> None:
    src = Path(__file__).resolve().parents[2] / "src"
    env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path / "ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "released", proc.stderr[-3000:]
    assert (tmp_path / "ckpt" / ".metadata").is_file()
