"""Every verdict line is Megatron's failure line, ``Rank R, node N, device D, iteration #I:
{message}!`` (megatron-behaviour.md §1.1.6, ``log_failure``), on each verdict path's real
output: transient, persistent (exit 16 on one device, 17 on another), application (a correct
result), peer replay on 2 gloo ranks, and a fault in the first iteration (which Megatron never
validates, B4). In-process runs read the log records ``stalwart train`` writes to stderr; the peer
replay reads the ranks' streams. The peer replay's line had one "!" and read ``device cpu:1,
iteration 4:``.

Megatron's functional-test regex, ``Rank N, node ..., device N: Possible ... error!!``, omits the
iteration, so it matches no line that carries it (``log_failure``'s included).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from stalwart.distributed.process_group import DistributedContext
from stalwart.reliability.rerun import DEVICE_ID_ENV
from stalwart.train.trainer import run_training

from dist_utils import run_cli_on_ranks
from train_utils import TINY_FLAGS, make_config

# Megatron's log_failure form; the node is a hostname, the device an index.
FAILURE = re.compile(
    r"Rank (?P<rank>[0-9]+), node [^,\s]+, device (?P<device>[0-9]+), "
    r"iteration #(?P<it>[0-9]+): (?P<what>Possible (?:transient|persistent) error!!"
    r"|Correct result \(but possible Application error\) \([^)]*\)!)"
)


def _flags(save: Path, kind: str, at: int = 3) -> list[str]:
    return ["--train-iters", str(max(at, 2)), "--seed", "5", "--save", str(save),
            "--error-injection-rate", "1", "--error-injection-type", kind,
            "--error-injection-iterations", str(at)]  # fmt: skip


def _found(text: str) -> list[tuple[str, str, str, str]]:
    return [(m["rank"], m["device"], m["it"], m["what"]) for m in FAILURE.finditer(text)]


def _run(args: list[str]) -> int:
    return run_training(make_config(*args), DistributedContext()).exit_code


@pytest.mark.parametrize("at", [3, 1], ids=["iteration-3", "first-iteration"])
def test_transient_error_line(tmp_path: Path, caplog: pytest.LogCaptureFixture, at: int) -> None:
    caplog.set_level(logging.INFO)
    assert _run(_flags(tmp_path / "ckpt", "transient_error", at)) == 17, caplog.text[-3000:]
    assert _found(caplog.text) == [("0", "0", str(at), "Possible transient error!!")]
    record = next(r for r in caplog.records if FAILURE.search(r.getMessage()))
    line = record.getMessage()
    assert record.levelname == "ERROR"
    assert "error!! (device cpu:0) First rerun: unexpected result is not reproducible" in line


def test_persistent_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    save = tmp_path / "ckpt"
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    assert _run(_flags(save, "persistent_error")) == 16
    found = _found(caplog.text)
    assert found == [], found  # reproducible in place: no diagnosis yet
    caplog.clear()
    monkeypatch.setenv(DEVICE_ID_ENV, "7")  # relaunched on another device
    assert _run(_flags(save, "persistent_error")) == 17, caplog.text[-3000:]
    assert _found(caplog.text) == [("0", "7", "3", "Possible persistent error!!")]


def test_application_error_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    caplog.set_level(logging.INFO)
    save = tmp_path / "ckpt"
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-a")
    assert _run(_flags(save, "correct_result")) == 16
    caplog.clear()
    monkeypatch.setenv(DEVICE_ID_ENV, "gpu-b")
    assert _run(_flags(save, "correct_result")) == 17, caplog.text[-3000:]
    found = _found(caplog.text)
    assert [(r, d, i) for r, d, i, _ in found] == [("0", "0", "3")], caplog.text[-3000:]
    assert found[0][3].startswith("Correct result (but possible Application error) (")


@pytest.mark.distributed
def test_peer_replay_line_on_two_gloo_ranks(tmp_path: Path) -> None:
    """Rank 1 injected at iteration 3, reproducible in place, not on its peer: the peer
    replay's verdict line, on rank 1 (LOCAL_RANK 1: device index 1)."""
    save = tmp_path / "ckpt"
    argv = ["train", *TINY_FLAGS, "--train-iters", "3", "--global-batch-size", "8",
            "--seed", "5", "--save", str(save), "--error-injection-rate", "1",
            "--error-injection-type", "persistent_error", "--error-injection-iterations", "3",
            "--error-injection-ranks", "1", "--rerun-peer-replay"]  # fmt: skip
    run = run_cli_on_ranks(argv, tmp_path / "logs", unset=(DEVICE_ID_ENV,), timeout_s=240)
    assert run.codes == [17, 17], run.log[-4000:]
    assert _found(run.log) == [("1", "1", "3", "Possible persistent error!!")], run.log[-4000:]
    line = next(ln for ln in run.log.splitlines() if FAILURE.search(ln))
    assert "error!! (device cpu:1) (message='" in line
