"""scripts/gpu_check.sh on CPU: its steps' own commands, and its verdict when a step fails.

A fake ``python3`` first on PATH stands in for the device's interpreter: it runs this venv's
python with the CUDA-only flags removed (the resume test), or only exits with a chosen code (the
verdict test), so the script's real step lines are what runs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"

# Runs the CPU python with the graph flags (refused on CPU) removed and a CPU-sized model (the
# last value of a flag wins; iterations and schedule stay the script's); "-c" probes exit 0.
_CPU_PYTHON = """#!/usr/bin/env bash
[ "$1" = "-c" ] && exit 0
args=(); skip=0
for a in "$@"; do
  if [ "$skip" = 1 ]; then skip=0; continue; fi
  case "$a" in
    --optimizer-cuda-graph) continue ;;
    --cuda-graph-impl) skip=1; continue ;;
  esac
  args+=("$a")
done
exec "$REAL_PYTHON" "${args[@]}" --num-layers 1 --hidden-size 64 --num-attention-heads 2 \
  --seq-length 32 --vocab-size 512
"""

# Exits 0 for everything: a divergence step (expected 16) then "passes" with the wrong code.
_ZERO_PYTHON = "#!/usr/bin/env bash\nexit 0\n"


def _run_script(tmp_path: Path, fake: str, steps: str, timeout: float) -> tuple[int, str, str]:
    if shutil.which("bash") is None or shutil.which("timeout") is None:
        pytest.skip("needs bash and coreutils' timeout")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    python3 = bin_dir / "python3"
    python3.write_text(fake)
    python3.chmod(0o755)
    out = tmp_path / "out"
    env = dict(os.environ)
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env.get('PATH', '')}",
        REAL_PYTHON=sys.executable,
        OUT=str(out),
        STEPS=steps,
        TMPDIR=str(tmp_path),
        CUDA_VISIBLE_DEVICES="",
    )
    proc = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc.returncode, proc.stdout, proc.stderr


def _summary_line(stdout: str, name: str) -> str:
    lines = [line for line in stdout.splitlines() if line.startswith(f"{name} rc=")]
    assert lines, f"no summary line for {name} in:\n{stdout[-3000:]}"
    return lines[-1]


def test_a_step_with_the_wrong_exit_code_fails_the_script_and_is_named(tmp_path: Path) -> None:
    rc, stdout, stderr = _run_script(
        tmp_path, _ZERO_PYTHON, "train_eager train_diverge_plain", timeout=60
    )
    assert rc == 1
    assert _summary_line(stdout, "train_eager").endswith(" ok")
    assert "FAILED" in _summary_line(stdout, "train_diverge_plain")
    assert "== FAILED step: train_diverge_plain rc=0 (expected 16)" in stderr
    assert "train_eager" not in stderr


@pytest.mark.slow
def test_the_resume_across_modes_steps_pass_with_their_own_commands(tmp_path: Path) -> None:
    """The eager run, then its resume (graph flags removed on CPU): the resume's longer
    --train-iters keeps the checkpoint's schedule, so Megatron's rule accepts it (exit 0)."""
    steps = "train_eager train_resume_eager_to_graphs"
    rc, stdout, stderr = _run_script(tmp_path, _CPU_PYTHON, steps, timeout=400)
    assert _summary_line(stdout, "train_eager").startswith("train_eager rc=0 ")
    line = _summary_line(stdout, "train_resume_eager_to_graphs")
    assert line.startswith("train_resume_eager_to_graphs rc=0 "), (line, stderr[-2000:])
    assert rc == 0, stderr[-2000:]
    assert "== all steps passed" in stdout
