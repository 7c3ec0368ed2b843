"""``stalwart goodput --project N,...``: the ETTR table against a hand computation on a small
synthetic ledger, bad input (exit 2, one line), JSON, and the report's ETTR section."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stalwart.cli.main import main
from stalwart.observability.goodput.records import GOODPUT_FILE
from stalwart.report.run_report import write_report

T0 = 1_000_000.0


def _span(b: str, t0: float, t1: float, s: str, it: int | None = None, **kw: object) -> dict:
    out: dict = {"k": "span", "b": b, "t0": T0 + t0, "t1": T0 + t1, "s": s, **kw}
    if it is not None:
        out["it"] = it
    return out


def _marker(k: str, t: float, s: str, **kw: object) -> dict:
    return {"k": k, "t": T0 + t, "s": s, **kw}


# Three sessions. a: trains at 2 s per iteration, saves at 10 and 20 (1 s each), its step 23
# raises (1 s lost), 3 s of teardown written by it. b: 20 s after a's end, 15 s start-up,
# 4 s warm compile, iteration 21..22 again (2 s), saves at 30 (2 s), hangs after iteration 33;
# the watchdog detects it 10 s later, 15 s until c starts. c: 10 s start-up, 31..33 again (6 s),
# saves at 40 (1 s), finishes.
LEDGER = [
    _marker("session", 0, "a", launcher_start=T0, restart_count=0, attempt=0),
    _span("startup", 0, 10, "a"),
    _marker("resume", 10, "a", it=0),
    _span("compile", 10, 12, "a", 1, src="cold"),
    _span("productive", 12, 30, "a", 10),
    _span("checkpoint", 30, 31, "a", 10),
    _span("productive", 31, 51, "a", 20),
    _span("checkpoint", 51, 52, "a", 20),
    _span("productive", 52, 56, "a", 22),
    _span("lost_work", 56, 57, "a", 22),
    _span("restart", 57, 60, "a", 22),
    _marker("end", 60, "a", reason="fault", detail="RuntimeError: injected"),
    _marker("session", 80, "b", launcher_start=T0 + 80, restart_count=1, attempt=0),
    _span("restart", 60, 80, "b", gap=True),
    _span("restart", 80, 95, "b"),
    _marker("resume", 95, "b", it=20),
    _span("compile", 95, 99, "b", 21, src="warm"),
    _span("lost_work", 99, 101, "b", 22),
    _span("productive", 101, 117, "b", 30),
    _span("checkpoint", 117, 119, "b", 30),
    _span("productive", 119, 125, "b", 33),
    _marker("fault", 135, "hang-monitor-rank0", cause="hang", detail="no progress"),
    _marker("session", 150, "c", launcher_start=T0 + 150, restart_count=2, attempt=0),
    _span("hang", 125, 135, "c", gap=True),
    _span("restart", 135, 150, "c", gap=True),
    _span("restart", 150, 160, "c"),
    _marker("resume", 160, "c", it=30),
    _span("lost_work", 160, 166, "c", 33),
    _span("productive", 166, 180, "c", 40),
    _span("checkpoint", 180, 181, "c", 40),
    _marker("end", 181, "c", reason="finished"),
]

# By hand. Per recovery (detection, teardown, restart, recompile, lost work):
EXCEPTION = (0.0, 3 + 20, 15.0, 4.0, 1 + 2)  # a -> b
HANG = (10.0, 0 + 15, 10.0, 0.0, 0 + 6)  # b -> c
MEAN = tuple((x + y) / 2 for x, y in zip(EXCEPTION, HANG))
# Checkpoints: saves at 10, 20, 30, 40 (median step 10 iterations); productive 78 s over 39
# iterations (2 s each): dt = 20 s; w = (1 + 1 + 2 + 1) / 4 = 1.25 s; lost work dt/2 = 10 s.
DT, W = 20.0, 1.25
C = sum(MEAN[:4]) + DT / 2  # 48.5 s per failure


def _ettr(c: float, mttf: float, w: float = W) -> float:
    return max(1 - c / mttf, 0.0) / (1 + w / DT)


@pytest.fixture()
def run_dir(tmp_path: Path) -> Path:
    lines = "".join(json.dumps(r) + "\n" for r in LEDGER)
    (tmp_path / GOODPUT_FILE).write_text(lines)
    return tmp_path


def _rows(out: str, title: str) -> dict[str, list[str]]:
    """The rows of the table under ``title``: first cell -> the other cells."""
    block = out.split(title + "\n", 1)[1].split("\n\n", 1)[0].splitlines()
    rows = {}
    for line in block:
        name, cells = line[:16].strip(), line[16:].split()
        rows[name or "header"] = cells
    return rows


def test_projection_matches_a_hand_computation(run_dir: Path, capsys) -> None:
    # MTTF 1 h at 1,000 GPUs: 3600 s at 1,000, 360 s at 10,000, 36 s at 100,000 (< C).
    args = ["goodput", "--project", "1000,10000,100000", "--mttf", "1@1000", str(run_dir)]
    assert main(args) == 0
    out = capsys.readouterr().out
    measured = _rows(out, "measured per recovery (mean seconds)")
    for kind, parts in (("exception", EXCEPTION), ("hang", HANG), ("all failures", MEAN)):
        count = "2" if kind == "all failures" else "1"
        assert measured[kind] == [count, *(f"{v:.1f}" for v in parts), f"{sum(parts):.1f}"], kind
    assert "every 10 iterations x 2.000 s = 20.0 s of training (dt, measured)" in out
    assert "1.25 s blocking per save (w; saves: 4)" in out
    assert f"= {C:.1f} s per failure" in out and C == 48.5
    mttfs = (3600.0, 360.0, 36.0)
    scale = [line.split() for line in out.split("Young dt*\n", 1)[1].split("\n\n")[0].splitlines()]
    for row, n, mttf in zip(scale, ("1,000", "10,000", "100,000"), mttfs):
        assert row[0] == n and row[2] == f"{86400 / mttf:.2f}"
        assert row[3] == f"{100 * _ettr(C, mttf):.2f}%"
    assert scale[2][3] == "0.00%"  # a failure every 36 s, 48.5 s to recover: no progress
    by_kind = _rows(out, "ETTR if every failure cost what this kind cost")
    for kind, parts in (("exception", EXCEPTION), ("hang", HANG)):
        cost = sum(parts[:4]) + DT / 2
        assert by_kind[kind] == [f"{100 * _ettr(cost, m):.2f}%" for m in mttfs], kind
    halved = _rows(out, "sensitivity: ETTR gained if the component were halved (points)")
    gain = 100 * (_ettr(C - MEAN[2] / 2, 3600) - _ettr(C, 3600))
    assert halved["restart"][0] == f"{gain:+.3f}" == "+0.163"
    gain = 100 * (_ettr(C, 3600, W / 2) - _ettr(C, 3600))
    assert halved["checkpoint write"][0] == f"{gain:+.3f}" == "+2.814"
    assert halved["lost work"][0] == f"{100 * (_ettr(C - 5, 3600) - _ettr(C, 3600)):+.3f}"
    slope = _rows(out, "sensitivity: d ETTR / d component (points per minute)")
    assert slope["teardown"][:2] == [f"{-6000 / (m * (1 + W / DT)):+.3f}" for m in mttfs[:2]]
    d_w = -6000 * (1 - C / 3600) / (DT * (1 + W / DT) ** 2)
    assert slope["checkpoint write"][0] == f"{d_w:+.3f}" and slope["restart"][2] == "+0.000"


def test_default_failure_model_and_json(run_dir: Path, capsys) -> None:
    assert main(["goodput", "--project", "1024,16384,131072", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "Revisiting Reliability in Large-Scale Machine Learning Research Clusters" in out
    assert "arXiv:2410.21680" in out and "MTTF(N) = 30,147 GPU-hours / N" in out
    assert main(["goodput", "--project", "1024,16384,131072", "--json", str(run_dir)]) == 0
    data = json.loads(capsys.readouterr().out)
    gpu_hours = 0.23 * 131_072  # the paper's projection for 131,072 GPUs, inverse in N
    for point, n in zip(data["points"], (1024, 16_384, 131_072)):
        mttf = 3600 * gpu_hours / n
        assert point["gpus"] == n and point["mttf_s"] == pytest.approx(mttf)
        assert point["ettr"] == pytest.approx(_ettr(C, mttf))
        assert point["young_interval_s"] == pytest.approx((2 * W * mttf) ** 0.5)
    assert data["points"][1]["mttf_s"] == pytest.approx(1.84 * 3600)  # the paper's 1.8 h
    assert [r["kind"] for r in data["recoveries"]] == ["exception", "hang"]
    assert data["checkpoint"]["interval_s"] == pytest.approx(DT)
    assert data["cost_s"]["per_failure"] == pytest.approx(C)


def test_checkpoint_interval_flag_replaces_the_measured_one(run_dir: Path, capsys) -> None:
    args = ["goodput", "--project", "1000", "--mttf", "1@1000", "--checkpoint-interval", "600"]
    assert main([*args, "--json", str(run_dir)]) == 0
    data = json.loads(capsys.readouterr().out)
    cost = sum(MEAN[:4]) + 300
    assert data["points"][0]["ettr"] == pytest.approx((1 - cost / 3600) / (1 + W / 600))


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--project", "0"], "argument --project"),
        (["--project", "-1024"], "argument --project"),
        (["--project=-5"], "argument --project"),
        (["--project", "lots"], "argument --project"),
        (["--project", "1024,"], "argument --project"),
        (["--project", "1e3"], "argument --project"),
        (["--project", "1024,abc"], "argument --project"),
        (["--project", ",".join(["8"] * 17)], "at most 16"),
        (["--project", "8", "--mttf", "nan@8"], "argument --mttf"),
        (["--project", "8", "--mttf", "7.9"], "argument --mttf"),
        (["--project", "8", "--mttf", "7.9@-1"], "argument --mttf"),
        (["--project", "8", "--checkpoint-interval", "-3"], "argument --checkpoint-interval"),
        (["--mttf", "7.9@1024"], "--mttf is a setting of --project"),
        (["--checkpoint-interval", "60"], "--checkpoint-interval is a setting of --project"),
    ],
)
def test_bad_input_is_exit_2_with_one_line(run_dir: Path, capsys, flags, needle) -> None:
    assert main(["goodput", *flags, str(run_dir)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and needle in captured.err


def test_no_ledger_or_nothing_to_project_is_exit_2(tmp_path: Path, capsys) -> None:
    assert main(["goodput", "--project", "1024", str(tmp_path)]) == 2
    assert "no goodput.jsonl" in capsys.readouterr().err
    finished = [r for r in LEDGER if r["s"] == "a"][:-1]
    finished.append(_marker("end", 60, "a", reason="finished"))
    (tmp_path / GOODPUT_FILE).write_text("".join(json.dumps(r) + "\n" for r in finished))
    assert main(["goodput", "--project", "1024", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "records no recovery from a fault" in err


def test_report_has_the_ettr_section(run_dir: Path, tmp_path: Path) -> None:
    page = write_report(run_dir, pngs=False).read_text()
    section = page.split('<section id="ettr">', 1)[1].split("</section>", 1)[0]
    mttf = 3600 * 0.23 * 131_072 / 16_384
    assert f"{100 * _ettr(C, mttf):.2f}%" in section and "arXiv:2410.21680" in section
    assert "<td>exception</td>" in section and "<td>hang</td>" in section
    # A run without a ledger (its first log line only) still gets a report, saying so here.
    no_ledger = tmp_path / "no_ledger"
    no_ledger.mkdir()
    (no_ledger / "events.jsonl").write_text("")
    assert "goodput.jsonl: not available" in write_report(no_ledger, pngs=False).read_text()
