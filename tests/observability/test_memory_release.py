"""--empty-unused-memory-level: where the allocator cache is emptied, and the flag's validation."""

from __future__ import annotations

import pytest
import torch

from stalwart.cli.args import parse_train_args
from stalwart.config.run import build_run_config
from stalwart.observability.memory_release import (
    MemoryReleaseConfig,
    NullMemoryRelease,
    UnusedMemoryRelease,
)


@pytest.mark.parametrize(
    ("level", "expected"),
    [(1, ["fb", "eval"]), (2, ["fb", "step", "eval"])],
)
def test_levels_empty_the_cache_at_megatrons_points(level: int, expected: list[str]) -> None:
    calls: list[str] = []
    where = ["?"]
    release = UnusedMemoryRelease(level, empty_cache=lambda: calls.append(where[0]))
    for point, call in (
        ("fb", release.after_forward_backward),
        ("step", release.after_optimizer_step),
        ("eval", release.after_eval_step),
    ):
        where[0] = point
        call()
    assert calls == expected


def test_null_on_cpu_and_at_level_zero() -> None:
    off, on = MemoryReleaseConfig(), MemoryReleaseConfig(empty_unused_memory_level=2)
    assert isinstance(off.build(torch.device("cuda", 0)), NullMemoryRelease)
    assert isinstance(on.build(torch.device("cpu")), NullMemoryRelease)
    assert isinstance(on.build(torch.device("cuda", 0)), UnusedMemoryRelease)
    for bad in (3, -1, True, "1"):
        with pytest.raises(ValueError, match="--empty-unused-memory-level"):
            MemoryReleaseConfig(empty_unused_memory_level=bad)  # type: ignore[arg-type]


def test_flags_reach_the_config() -> None:
    argv = ["--save-wgrads-interval", "5", "--save-params-interval", "7"]
    argv += ["--empty-unused-memory-level", "2", "--no-exit-on-interrupt"]
    config = build_run_config(parse_train_args(argv), argv)
    dumps = config.shell.dumps
    assert (dumps.save_wgrads_interval, dumps.save_params_interval) == (5, 7)
    assert (
        config.shell.memory_release.empty_unused_memory_level == 2
        and config.shell.exit.exit_on_interrupt is False
    )
    on = ["--exit-on-interrupt"]
    assert build_run_config(parse_train_args(on), on).shell.exit.exit_on_interrupt is True


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--save-wgrads-interval", "-3"], "--save-wgrads-interval"),
        (["--save-params-interval", "x"], "--save-params-interval"),
        (["--empty-unused-memory-level", "3"], "--empty-unused-memory-level"),
    ],
)
def test_bad_values_exit_2_with_one_line(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        parse_train_args(argv)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0]
