"""The chaos campaign's goodput columns: each faulted job's ledger, the cost of its recovery."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.chaos.campaign import CampaignOutcome, format_table
from stalwart.chaos.result import FaultResult, goodput_cost
from stalwart.observability.goodput.records import GOODPUT_FILE


def _ledger(run_dir: Path, spans: list[tuple[str, float, float]]) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"k": "span", "b": b, "t0": t0, "t1": t1, "s": "x"}) for b, t0, t1 in spans]
    (run_dir / GOODPUT_FILE).write_text("\n".join(lines) + "\n")


def test_cost_is_restart_hang_lost_work_and_rerun(tmp_path) -> None:
    _ledger(tmp_path / "hang", [("startup", 0, 5), ("productive", 5, 15), ("hang", 15, 18),
                                ("restart", 18, 24), ("lost_work", 24, 26), ("productive", 26, 30)])  # fmt: skip
    cost = goodput_cost(tmp_path / "hang")
    assert cost is not None
    assert cost.wall_s == 30.0 and cost.goodput == pytest.approx(14 / 30)
    assert cost.recovery_s == 11.0 and cost.recovery_pct == pytest.approx(100 * 11 / 30)
    assert goodput_cost(tmp_path / "none") is None
    _ledger(tmp_path / "ref", [("startup", 0, 5), ("productive", 5, 15)])
    res = FaultResult(kind="hang", goodput=cost)
    outcome = CampaignOutcome(
        [res], tmp_path, 1.0, reference_goodput=goodput_cost(tmp_path / "ref")
    )
    table = format_table(outcome, markdown=True)
    header, _, reference, row = table.splitlines()[:4]
    assert header.endswith("| goodput_pct | recovery_s | recovery_pct |")
    assert reference.startswith("| reference (no fault) |") and reference.endswith(
        "| 66.7 | 0.0 | 0.0 |"
    )
    assert row.endswith("| 46.7 | 11.0 | 36.7 |")
    assert res.to_json()["goodput"]["seconds"]["hang"] == 3.0
    assert outcome.to_json()["reference_goodput"]["goodput_pct"] == 66.67
