"""The timeout hierarchy: a set-up where a lower tier can never fire first is refused."""

from __future__ import annotations

import pytest

from stalwart.reliability.hang.tiers import Escalation, check_timeout_hierarchy

ESC = Escalation()


def test_defaults_are_a_valid_hierarchy() -> None:
    # stalwart's defaults: step 180 s, checkpointing 420 s, process group 10 min, in-process 60 s
    check_timeout_hierarchy(step_s=180, checkpointing_s=420, escalation=ESC,
                            process_group_timeout_s=600, inprocess_soft_timeout_s=60)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "flags"),
    [
        (dict(step_s=600, checkpointing_s=60, process_group_timeout_s=600),
         ("--ft-timeouts step=600", "--distributed-timeout-minutes")),
        (dict(step_s=60, checkpointing_s=598, process_group_timeout_s=600),
         ("--ft-timeouts checkpointing=598", "--distributed-timeout-minutes (10 min = 600 s)")),
        (dict(step_s=30, checkpointing_s=60, process_group_timeout_s=600,
              inprocess_soft_timeout_s=30),
         ("--inprocess-soft-timeout 30", "--ft-timeouts step=30")),
    ],
)  # fmt: skip
def test_unreachable_tier_is_refused_in_one_line(kwargs, flags) -> None:
    with pytest.raises(ValueError) as err:
        check_timeout_hierarchy(escalation=ESC, **kwargs)
    message = str(err.value)
    assert "\n" not in message and all(f in message for f in flags), message


def test_off_tiers_are_not_checked() -> None:
    check_timeout_hierarchy(step_s=None, checkpointing_s=None, escalation=ESC,
                            process_group_timeout_s=1, inprocess_soft_timeout_s=99)  # fmt: skip
    check_timeout_hierarchy(step_s=900, checkpointing_s=900, escalation=ESC,
                            process_group_timeout_s=None)  # fmt: skip


def test_escalation_total() -> None:
    assert Escalation(poll_s=1, dump_wait_s=1, abort_grace_s=2, kill_grace_s=3).total_s == 7
