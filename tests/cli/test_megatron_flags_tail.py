"""The long tail of Megatron-LM's flags (MLA, Retro, inference, hybrid Mamba, vision, RL, ...) is
refused by name with its group's reason, exit code 2, one line (issue 30 item 11); before, such a
flag got the generic "neither a stalwart flag nor a Megatron flag stalwart knows"."""

from __future__ import annotations

import pytest

from stalwart.cli.args import build_train_parser
from stalwart.cli.main import main
from stalwart.cli.megatron_flags import ALWAYS, LONG_TAIL, UNSUPPORTED, MegatronRefusal
from stalwart.cli.megatron_flags_tail import TAIL, TAIL_ACCEPTED

from train_utils import TINY_FLAGS

REFUSED = "is a Megatron flag stalwart does not implement"
# One flag per group: its first value flag, else its first switch.
SAMPLE = [
    (reason, (values or switches).split()[0], bool(values)) for reason, values, switches in TAIL
]


def _one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    code = main(["train", *TINY_FLAGS, *argv, "--print-config"])
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(("reason", "flag", "takes_value"), SAMPLE, ids=[s[1] for s in SAMPLE])
def test_one_flag_per_tail_group_is_refused_with_its_reason(
    capsys: pytest.CaptureFixture[str], reason: str, flag: str, takes_value: bool
) -> None:
    forms = [[flag, "2"], [f"{flag}=2"], [flag]] if takes_value else [[flag]]
    for argv in forms:
        err = _one_line_error(capsys, argv)
        assert f"{flag} {REFUSED} ({reason})" in err, err
        assert "neither a stalwart flag" not in err, err


def test_every_tail_flag_is_refused_by_name_in_its_forms(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_train_parser()
    failures = []
    for u in LONG_TAIL:
        forms = [[u.flag, "7"], [f"{u.flag}=7"], [u.flag]] if u.takes_value else [[u.flag]]
        for argv in forms:
            with pytest.raises(SystemExit) as exc:
                parser.parse_args(argv)
            err = capsys.readouterr().err.strip()
            if exc.value.code != 2 or f"{u.flag} {REFUSED} ({u.reason})" not in err:
                failures.append(f"{argv}: {err}")
    assert not failures, "\n".join(failures)
    assert len(LONG_TAIL) >= 300  # the tail is the whole of Megatron's remaining flags


def test_a_tail_switch_is_refused_in_a_config_file(
    capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    config = tmp_path / "run.toml"
    config.write_text("retro_add_retriever = true\n")
    err = _one_line_error(capsys, ["--config", str(config)])
    assert f"--retro-add-retriever {REFUSED} (Retro retrieval is not implemented)" in err, err


@pytest.mark.parametrize(("flag", "value"), [(f, v[0]) for f, v in TAIL_ACCEPTED.items()])
def test_tail_values_that_mean_what_stalwart_does_are_accepted(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    assert main(["train", *TINY_FLAGS, flag, value, "--print-config"]) == 0
    capsys.readouterr()


def test_the_tail_has_no_overlap_with_stalwarts_flags_or_the_table() -> None:
    parser = build_train_parser()
    own = {
        option
        for action in parser._actions
        if not isinstance(action, MegatronRefusal)
        for option in action.option_strings
    }
    tail = [u.flag for u in LONG_TAIL]
    assert len(tail) == len(set(tail))
    assert not set(tail) & own
    assert not set(tail) & ({u.flag for u in UNSUPPORTED} | {a.flag for a in ALWAYS})
    assert set(TAIL_ACCEPTED) <= {u.flag for u in LONG_TAIL if u.takes_value}
