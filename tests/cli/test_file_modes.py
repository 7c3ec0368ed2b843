"""Every file and directory stalwart writes gets the umask's mode (docs/reliability.md, "Threat
model"): a teammate's job reads them under umask 022, nobody else under 077. A short training
run with every artefact switched on, the three export formats and the report, each command run
in a process whose umask is set before anything is written; then every entry below is checked.

Deliberate exceptions, kept explicit here: the compile cache (``compile_cache/``, 0700 and its
files 0600, because the run executes what it holds; tests/graphs/test_compile_cache.py) is not
written by this run (no --compile), and the hang monitor's heartbeat (0600, an mmap shared
with the monitor process, outside the run directory in /dev/shm or the temp directory, removed
at the end) is not below it.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

from train_utils import REPO, TINY_FLAGS

SCRIPT = """
import os, sys
os.umask(int(sys.argv[1], 8))
root = sys.argv[2]
from stalwart.cli.main import main
save, tb, out = (os.path.join(root, d) for d in ("ckpt", "tb", "exp"))
llama = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear"]
codes = [main(["train", *sys.argv[3:], *llama, "--train-iters", "8", "--save-interval", "3",
               "--save", save, "--exit-interval", "6", "--log-straggler", "--log-progress",
               "--log-memory-interval", "5", "--save-params-interval", "5",
               "--tensorboard-dir", tb, "--enable-ft", "--calc-ft-timeouts"])]
codes += [main(["export", "--load", save, "--out", os.path.join(out, name)])
          for name in ("model.pt", "model.safetensors")]
codes.append(main(["export", "--load", save, "--format", "hf", "--out", os.path.join(out, "hf")]))
codes.append(main(["report", save]))
sys.exit(1 if any(codes) else 0)
"""

# One of each kind this run must leave (a mode test over an empty tree cannot fail).
EXPECTED = {
    "ckpt/latest_checkpointed_iteration.txt",
    "ckpt/iter_0000006/COMPLETE",
    "ckpt/iter_0000006/.metadata",
    "ckpt/iter_0000006/__0_0.distcp",
    "ckpt/iter_0000006/checksums.json",
    "ckpt/iter_0000006/common.json",
    "ckpt/iter_0000006/rank_00000.json",
    "ckpt/iter_0000006/metadata.json",
    "ckpt/metrics.jsonl",
    "ckpt/events.jsonl",
    "ckpt/goodput.jsonl",
    "ckpt/run.json",
    "ckpt/exit_reason.json",
    "ckpt/straggler.jsonl",
    "ckpt/memory.json",
    "ckpt/progress.txt",
    "ckpt/ft_state.json",
    "ckpt/params/iter_0000005/rank0.pt",
    "ckpt/report.html",
    "ckpt/report/loss.png",
    "exp/model.pt",
    "exp/model.safetensors",
    "exp/hf/model.safetensors",
    "exp/hf/config.json",
}


def _start(root: Path, umask: int) -> subprocess.Popen[str]:
    root.mkdir(mode=0o777 & ~umask)
    os.chmod(root, 0o777 & ~umask)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    env.pop("WANDB_MODE", None)
    cmd = [sys.executable, "-c", SCRIPT, f"{umask:o}", str(root), *TINY_FLAGS]
    return subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root
    )


def _wrong_modes(root: Path, umask: int) -> list[str]:
    wrong = []
    for path in [root, *root.rglob("*")]:
        st = path.lstat()
        if stat.S_ISLNK(st.st_mode):
            wrong.append(f"{path}: a symbolic link")
            continue
        want = (0o777 if stat.S_ISDIR(st.st_mode) else 0o666) & ~umask
        if stat.S_IMODE(st.st_mode) != want:
            wrong.append(f"{path.relative_to(root)}: {stat.S_IMODE(st.st_mode):o}, not {want:o}")
    return wrong


def test_every_file_written_by_train_export_and_report_has_the_umask_s_mode(
    tmp_path: Path,
) -> None:
    procs = {umask: _start(tmp_path / f"u{umask:o}", umask) for umask in (0o022, 0o077)}
    for umask, proc in procs.items():
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-4000:]
        root = tmp_path / f"u{umask:o}"
        written = {str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()}
        assert not EXPECTED - written, sorted(EXPECTED - written)
        assert any(p.startswith("tb/events.out.tfevents") for p in written)
        assert _wrong_modes(root, umask) == []


def test_appended_records_follow_a_group_writable_umask(tmp_path: Path) -> None:
    """The ledger's append opens (the launcher's action, the hang monitor's fault) create with
    0666 minus the umask, as open() does: a team's umask 002 gives 0664, not a fixed 0644."""
    from stalwart.observability.goodput import record_action
    from stalwart.reliability.hang.monitor import Overrun, _append_goodput_fault

    old = os.umask(0o002)
    try:
        record_action(tmp_path / "a", "restart", "rank 1 exited 3")
        _append_goodput_fault(str(tmp_path / "b.jsonl"), 0, Overrun("step", 9.0, 5.0))
    finally:
        os.umask(old)
    for path in (tmp_path / "a" / "goodput.jsonl", tmp_path / "b.jsonl"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o664, path
