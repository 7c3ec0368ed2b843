from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch

from stalwart.observability.straggler import (
    STRAGGLER_FILE,
    NullStragglerDetector,
    StragglerDetector,
    build_report,
    make_straggler_detector,
)
from stalwart.observability.train_log import IntervalInfo


def test_build_report_names_slow_rank() -> None:
    r = build_report(10, [10.0, 10.5, 30.0, 9.5], threshold=1.2, minmax_count=2)
    assert r.median_ms == pytest.approx(10.25)
    assert (r.min_ms, r.max_ms) == (9.5, 30.0)
    assert r.slowest == [(2, 30.0), (1, 10.5)]
    assert r.fastest == [(3, 9.5), (0, 10.0)]
    assert r.stragglers == [2]
    assert r.relative_throughput[2] == pytest.approx(10.25 / 30.0)
    fields = {f.label: f for f in r.fields()}
    assert fields["slowest rank"].value == 2
    assert fields["straggler ranks"].value == "2"
    assert fields["stragglers"].value == 1
    assert r.scalars()["straggler/num-stragglers"] == 1.0


def test_build_report_no_straggler_when_balanced() -> None:
    r = build_report(1, [5.0, 5.1], threshold=1.2)
    assert r.stragglers == []
    assert all(f.label != "straggler ranks" for f in r.fields())


@pytest.mark.parametrize(("threshold", "count"), [(1.0, 1), (float("nan"), 1), (1.5, 0)])
def test_bad_flags_raise(threshold: float, count: int) -> None:
    with pytest.raises(ValueError, match=r"--straggler-threshold|--straggler-minmax-count"):
        make_straggler_detector(True, torch.device("cpu"), threshold=threshold, minmax_count=count)


def test_cpu_detector_times_only_compute(tmp_path: Path) -> None:
    det = StragglerDetector(torch.device("cpu"), run_dir=tmp_path)
    for _ in range(2):
        with det.compute():
            time.sleep(0.01)
        time.sleep(0.02)  # "collective" wait outside compute(): not counted
        det.step()
    info = IntervalInfo(
        iteration=2,
        num_iterations=2,
        elapsed_ms_per_iteration=0.0,
        consumed_samples=0,
        is_first=False,
    )
    fields = det.log_fields(info)
    report = det.last_report
    assert report is not None and fields
    assert 9.0 <= report.compute_ms[0] < 25.0
    line = json.loads((tmp_path / STRAGGLER_FILE).read_text().splitlines()[0])
    assert line["iteration"] == 2 and len(line["compute_ms"]) == 1
    # The interval was reset by the report.
    assert det.report(3, num_iterations=1).compute_ms == [0.0]


def test_null_detector_does_nothing() -> None:
    det = make_straggler_detector(False, torch.device("cpu"))
    assert isinstance(det, NullStragglerDetector)
    with det.compute():
        pass
    assert det.report(1) is None and det.scalars() == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_compute() -> None:
    det = StragglerDetector(torch.device("cuda", 0))
    x = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        with det.compute():
            for _ in range(20):
                x = (x @ x).tanh_()
        det.step()
    report = det.report(3)
    print(f"\ncuda compute ms/iter: {report.compute_ms}")
    assert report.compute_ms[0] > 0.0
