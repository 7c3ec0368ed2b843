"""Fault injection tied to a device (``--error-injection-devices``), once per job
(``--error-injection-once``), and the device ids ``stalwart launch`` hands its workers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from stalwart.distributed.launch_env import check_launch_env
from stalwart.reliability.rerun import RerunConfig, RerunErrorInjector, device_identity

KEY = ("loss", "found NaN", 1)


def test_only_the_listed_device_injects() -> None:
    inj = RerunErrorInjector(1, "persistent_error", devices=["dev-b"], at_iterations={3})
    assert not inj.maybe_inject(KEY, 3, 1, ("node", "dev-a"))  # rank 1 elsewhere: clean
    assert inj.maybe_inject(KEY, 3, 0, ("node", "dev-b"))  # any rank on the faulty device


def test_once_per_job_across_launches(tmp_path: Path) -> None:
    first = RerunErrorInjector(1, "transient_error", at_iterations={5}, marker_dir=str(tmp_path))
    assert first.maybe_inject(KEY, 5, 1, ("n", "d"))
    assert (tmp_path / ".stalwart_rerun_injected_6_1").exists()  # numbered as logged
    again = RerunErrorInjector(1, "transient_error", at_iterations={5}, marker_dir=str(tmp_path))
    assert not again.maybe_inject(KEY, 5, 1, ("n", "d"))  # the relaunch trains it cleanly
    assert RerunErrorInjector(1, "transient_error", at_iterations={5}).maybe_inject(
        KEY, 5, 1, ("n", "d")
    )  # without the flag: every launch injects (as before)


def test_once_needs_a_marker_directory() -> None:
    config = RerunConfig(error_injection_rate=1, error_injection_once=True)
    with pytest.raises(ValueError, match="--error-injection-once needs --save"):
        config.build("cpu")
    with pytest.raises(ValueError, match="--error-injection-devices/--error-injection-once need"):
        RerunConfig(error_injection_devices=["dev-b"])


def test_device_identity_reads_the_launchers_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("STALWART_DEVICE_ID", raising=False)
    monkeypatch.setenv("STALWART_VISIBLE_DEVICES", "dev-a,dev-c")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert device_identity()[1] == "dev-c"
    monkeypatch.setenv("STALWART_DEVICE_ID", "pinned")  # the explicit override still wins
    assert device_identity()[1] == "pinned"


def test_cuda_identity_is_the_physical_id(monkeypatch: pytest.MonkeyPatch) -> None:
    """After the launcher drops GPU 1 (CUDA_VISIBLE_DEVICES=0,2), local device 1 is GPU 2."""
    for name in ("STALWART_DEVICE_ID", "STALWART_VISIBLE_DEVICES"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert device_identity()[1] == "2"
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert device_identity()[1] == "1"


@pytest.mark.parametrize(
    ("env", "message"),
    [({"STALWART_VISIBLE_DEVICES": "a,,b"}, "must be a comma list of device ids"),
     ({"STALWART_VISIBLE_DEVICES": "a", "LOCAL_RANK": "1"}, "names 1 device(s), but LOCAL_RANK is 1")],
)  # fmt: skip
def test_bad_device_list_is_one_error(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match="STALWART_VISIBLE_DEVICES") as info:
        check_launch_env(env)
    assert message in str(info.value)
