"""docs/tutorial.md runs as written, section by section, on CPU.

Each section runs in a fresh directory: every ``python`` block that starts with ``# file: NAME``
of the page is saved there under that name, then the section's ``bash`` blocks run in order
(``bash -e``, with this interpreter's ``python`` and ``stalwart`` first on ``PATH``), except
those whose first line says ``# not run``. What each section claims is then checked on the
files the runs left (exit codes, checkpoints, the launcher's actions).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "tutorial.md"
BLOCK = re.compile(r"^```(\w+)\n(.*?)^```$", flags=re.DOTALL | re.MULTILINE)
BLOCK_TIMEOUT_S = 300


def _sections() -> dict[str, str]:
    parts = PAGE.read_text().split("\n## ")[1:]
    return {part.split("\n", 1)[0]: part for part in parts}


def _blocks(text: str) -> list[tuple[str, str]]:
    return [(lang, body) for lang, body in BLOCK.findall(text)]


def _files() -> dict[str, str]:
    files = {}
    for lang, body in _blocks(PAGE.read_text()):
        first = body.split("\n", 1)[0]
        if lang == "python" and first.startswith("# file: "):
            files[first.removeprefix("# file: ").strip()] = body
    return files


def _runnable(text: str) -> list[str]:
    return [b for lang, b in _blocks(text) if lang == "bash" and not b.startswith("# not run")]


def _run_section(title: str, cwd: Path) -> str:
    for name, body in _files().items():
        (cwd / name).write_text(body)
    bin_dir = os.path.dirname(sys.executable)
    env = {
        **os.environ,
        "PATH": bin_dir + os.pathsep + os.environ.get("PATH", ""),
        "PYTHONPATH": str(REPO / "src"),
        "OMP_NUM_THREADS": "1",
    }
    env.pop("STALWART_DEVICE_ID", None)
    out = []
    for block in _runnable(_sections()[title]):
        proc = subprocess.run(
            ["bash", "-e", "-c", block], cwd=cwd, env=env, capture_output=True, text=True,
            timeout=BLOCK_TIMEOUT_S,
        )  # fmt: skip
        out.append(proc.stdout + proc.stderr)
        assert proc.returncode == 0, f"{block}\n---\n{out[-1][-4000:]}"
    return "\n".join(out)


def _reason(run: Path) -> dict[str, object]:
    return json.loads((run / "exit_reason.json").read_text())  # type: ignore[no-any-return]


def _own_loop(cwd: Path, out: str) -> None:
    mine, bad = cwd / "runs" / "mine", cwd / "runs" / "bad"
    assert "exit code 0\n25\n" in out  # the preemption's save, then exit 0
    assert "iteration 26/40" in out  # the relaunch resumed after it
    assert (mine / "iter_0000025").is_dir()
    assert (mine / "latest_checkpointed_iteration.txt").read_text() == "40\n"
    assert _reason(mine)["reason"] == "finished"
    assert "exit code 16" in out
    assert _reason(bad)["exit_code"] == 16 and _reason(bad)["iteration"] == 11


def _lightning(cwd: Path, out: str) -> None:
    run = cwd / "runs" / "pl"
    assert (run / "iter_0000020.ckpt").is_file() and (run / "iter_0000010.ckpt").is_file()
    assert _reason(run)["exit_code"] == 0 and _reason(run)["iteration"] == 20


def _hf(cwd: Path, out: str) -> None:
    run = cwd / "runs" / "hf"
    assert (run / "checkpoint-8").is_dir() and (run / "checkpoint-4").is_dir()
    assert _reason(run)["exit_code"] == 0 and _reason(run)["iteration"] == 8


def _launch(cwd: Path, out: str) -> None:
    gpt, launched = cwd / "runs" / "gpt", cwd / "runs" / "launched"
    assert "usage: stalwart train" in out
    assert _reason(gpt)["iteration"] == 20 and (gpt / "iter_0000010").is_dir()
    assert "relaunching on the spare device(s) cpu:1 instead of cpu:0" in out
    assert _reason(launched) | {"time": None, "pid": None, "hostname": None} == {
        "reason": "finished", "iteration": 20, "detail": "reached ShellConfig.train_iters",
        "exit_code": 0, "time": None, "pid": None, "hostname": None,
    }  # fmt: skip
    assert "cpu:0" in (launched / "suspect_devices.json").read_text()
    actions = [line.split()[2] for line in out.splitlines() if re.match(r"\d{4}-\d\d-\d\d ", line)]
    assert actions[-3:] == ["move", "restart", "finished"], out[-3000:]


CHECKS: dict[str, tuple[str | None, Callable[[Path, str], None]]] = {
    "1. Your own loop": (None, _own_loop),
    "2. Lightning": ("lightning.pytorch", _lightning),
    "3. The Hugging Face Trainer": ("transformers", _hf),
    "4. The reference trainer and `stalwart launch`": (None, _launch),
}


def test_every_block_is_run_shown_or_marked() -> None:
    """Python blocks are files, bash blocks run unless marked, and each section with runnable
    blocks has its checks (a new section cannot go untested)."""
    for lang, body in _blocks(PAGE.read_text()):
        assert lang in ("python", "bash", "text"), lang
        if lang == "python":
            assert body.startswith("# file: "), body[:80]
    runnable = {title for title, text in _sections().items() if _runnable(text)}
    assert runnable == set(CHECKS)
    used = "\n".join(b for text in _sections().values() for b in _runnable(text))
    assert all(name.removesuffix(".py") in used for name in _files())


@pytest.mark.parametrize("title", list(CHECKS))
def test_the_section_runs_as_written(title: str, tmp_path: Path) -> None:
    module, check = CHECKS[title]
    if module is not None:
        pytest.importorskip(module)
    out = _run_section(title, tmp_path)
    check(tmp_path, out)
