"""Bad files a run meets (torn, binary, wrong type, a directory where a file belongs): one line,
the documented exit code, never a traceback, and nothing lost."""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.observability.sinks import JsonlSink
from stalwart.report.run_report import load_run

from train_utils import REPO, TINY_FLAGS, cli_env

TRAIN = [*TINY_FLAGS, "--train-iters", "4", "--seed", "5", "--log-interval", "1"]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    save = tmp_path_factory.mktemp("run") / "save"
    assert main(["train", *TRAIN, "--save", str(save), "--save-interval", "2"]) == 0
    return save


def _one_error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("stalwart ")]
    assert len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_load_elsewhere_without_a_checkpoint_exits_2(tmp_path: Path, capsys, caplog) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    for load in (tmp_path / "typo", empty):
        code = main(["train", *TRAIN, "--load", str(load), "--save", str(tmp_path / "s")])
        line = _one_error_line(capsys.readouterr().err)
        assert code == 2 and f"--load {load}" in line, line
    assert not (tmp_path / "s" / "iter_0000004").exists()
    caplog.set_level("INFO")
    code = main(["train", *TRAIN, "--train-iters", "1", "--save", str(tmp_path / "s")])
    assert code == 0 and f"no checkpoint in {tmp_path / 's'}, starting from scratch" in caplog.text


def test_exit_reason_json_being_a_directory_is_one_line_after_the_save(
    tmp_path, capsys, caplog
) -> None:
    save = tmp_path / "save"
    (save / "exit_reason.json").mkdir(parents=True)
    caplog.set_level("INFO")
    assert main(["train", *TRAIN, "--save", str(save)]) == 0
    assert "Traceback" not in capsys.readouterr().err
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 1 and "cannot write" in errors[0] and "exit_reason.json" in errors[0]
    assert (save / "latest_checkpointed_iteration.txt").read_text() == "4\n"


def test_torn_metrics_tail_does_not_swallow_the_next_record(run_dir, tmp_path, caplog) -> None:
    save = tmp_path / "save"
    shutil.copytree(run_dir, save)
    metrics = save / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    kept = [ln for ln in lines if json.loads(ln).get("iteration", 0) <= 2]
    metrics.write_text("\n".join(kept) + '\n{"split": "train", "iteration": 3, "lo')  # torn
    (save / "latest_checkpointed_iteration.txt").write_text("2\n")
    shutil.rmtree(save / "iter_0000004")
    caplog.set_level("WARNING")
    assert main(["train", *TRAIN, "--save", str(save)]) == 0
    assert "dropped a torn last record" in caplog.text
    records = [json.loads(line) for line in metrics.read_text().splitlines()]  # all parse
    assert [r["iteration"] for r in records if r.get("split") == "train"] == [1, 2, 3, 4]


def test_heal_torn_tail_cases(tmp_path: Path) -> None:
    from stalwart.observability.sinks import heal_torn_tail

    path = tmp_path / "m.jsonl"
    assert heal_torn_tail(path) == 0  # absent
    path.write_bytes(b'{"a": 1}\n{"b"')
    assert heal_torn_tail(path) == 4 and path.read_bytes() == b'{"a": 1}\n'
    path.write_bytes(b"\xff\xfe torn without any newline")
    assert heal_torn_tail(path) > 0 and path.read_bytes() == b""
    sink = JsonlSink(str(path))
    sink.write_record({"step": 1})
    sink.close()
    assert path.read_text() == '{"step": 1}\n'


def test_async_save_on_a_full_disk_is_one_line(tmp_path: Path) -> None:
    """A real write failure (RLIMIT_FSIZE: EFBIG even for root) of an async save: one line with
    the OS cause instead of DCP's per-rank tracebacks."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (256 * 1024, 256 * 1024))

    proc = subprocess.run(
        [sys.executable, "-m", "stalwart", "train", *TRAIN, "--save", str(tmp_path / "s"),
         "--save-interval", "2", "--async-save"],
        capture_output=True, text=True, env=cli_env(), cwd=REPO, timeout=180, preexec_fn=limit,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    line = _one_error_line(proc.stderr)
    assert line.startswith("stalwart train: checkpoint error: async checkpoint save")
    assert "rejects writes: File too large (rank 0: " in line, line


def _garbage(run: Path) -> None:
    (run / "exit_reason.json").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00binary")
    (run / "memory.json").write_text('["a", "list"]')
    rows = [{"split": "train", "iteration": "three", "loss": 1.0},
            {"split": "train", "iteration": None}, {"split": "train", "iteration": float("nan")},
            {"split": "train", "iteration": 2, "loss": "high", "forward-time-ms": "x"},
            [1, 2], {"split": "train", "iteration": True}]  # fmt: skip
    with open(run / "metrics.jsonl", "a") as f:
        f.write("".join(json.dumps(r) + "\n" for r in rows) + "\xff\xfe\n")
    (run / "events.jsonl").write_text('{"iteration": "x", "kind": 5}\n{"iteration": 1}\n')
    (run / "straggler.jsonl").write_text('{"iteration": 1, "compute_ms": ["a"]}\n')
    (run / "chaos.json").write_text('{"passed": "yes", "faults": 7}')


def test_report_and_checkpoints_skip_garbage_and_say_so(run_dir, tmp_path, capsys) -> None:
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    _garbage(run)
    assert main(["report", str(run), "--no-png"]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and (run / "report.html").is_file()
    notes = load_run(run).notes
    text = " | ".join(notes)
    assert "exit_reason.json: unreadable" in text and "memory.json: holds a JSON list" in text
    assert "metrics.jsonl: skipped" in text and "without a numeric iteration" in text
    assert "events.jsonl: skipped 2 record(s)" in text and "straggler.jsonl: skipped 1" in text
    assert main(["checkpoints", str(run), "--verify"]) == 0
    out = capsys.readouterr().out
    assert "last exit: unknown" in out and "exit_reason.json unreadable" in out
    (run / "exit_reason.json").write_text("[1, 2]")
    assert main(["checkpoints", str(run)]) == 0
    assert "holds a JSON list" in capsys.readouterr().out
    (run / "exit_reason.json").write_text('{"iteration": "x"}')
    assert main(["checkpoints", str(run)]) == 0
    assert "iteration is not an integer" in capsys.readouterr().out
    (run / "iter_0000004" / "metadata.json").write_bytes(b"\xff\x00")
    assert main(["checkpoints", str(run)]) == 0
    assert "saved by ? rank(s)" in capsys.readouterr().out
