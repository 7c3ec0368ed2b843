"""Warm restarts (`stalwart.compile.cache`): a relaunch loads what the first process
compiled, an in-process restart compiles nothing, an untrusted cache directory is refused."""

from __future__ import annotations

import doctest
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from stalwart.compile import cache as compile_cache
from stalwart.compile.cache import (
    ARTIFACTS_FILE,
    INDUCTOR_DIR,
    STAMP_FILE,
    CompileCache,
    CompileCounts,
    check_cache_dir,
)
from stalwart.distributed.process_group import DistributedContext
from stalwart.loop.compile_booking import CompileBooking
from stalwart.observability.goodput import Bucket, CompileSource, GoodputLedger
from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import Span, summarize
from stalwart.reliability.inprocess.store import RestartStore
from stalwart.reliability.inprocess.wrapper import Attempt, InProcessRestarter, RestartOptions

REPO = Path(__file__).resolve().parents[2]

# One process of a job: a tiny model compiled with Inductor under the cache, one forward and
# backward, the artifacts written; prints what compiled (torch's counters).
RELAUNCH = """
import json, sys
import torch
from stalwart.compile import CompileCache, CompileCounts
from stalwart.loop.compile_booking import compile_source

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))

with CompileCache(sys.argv[1]) as cache:
    model = Tiny()
    model.compile(dynamic=False)
    before = CompileCounts.read()
    model(torch.randn(4, 8)).sum().backward()
    counts = CompileCounts.read().since(before)
    wrote = cache.save()
print(json.dumps({**counts.fields(), "source": compile_source(counts).value, "wrote": wrote,
                  "loaded": cache.loaded_artifacts}))
"""


def _relaunch(cache_dir: Path) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    out = subprocess.run(
        [sys.executable, "-c", RELAUNCH, str(cache_dir)],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_docstring_example_runs() -> None:
    result = doctest.testmod(compile_cache, raise_on_error=True)
    assert result.attempted >= 3


@pytest.mark.slow
def test_a_relaunch_with_a_warm_cache_does_not_recompile(tmp_path: Path) -> None:
    cache = tmp_path / "compile_cache"
    cold = _relaunch(cache)
    assert cold["fx_miss"] and not cold["fx_hit"] and cold["source"] == "cold", cold
    assert cold["wrote"] and (cache / ARTIFACTS_FILE).stat().st_size > 0
    assert not (cache / INDUCTOR_DIR).stat().st_mode & 0o077  # created 0700

    warm = _relaunch(cache)
    assert warm["fx_hit"] and warm["fx_miss"] == 0 and warm["aot_miss"] == 0, warm
    assert warm["aot_hit"] and warm["source"] == "warm"
    # inductor/ holds what artifacts.bin holds (its stamp): not written there a second time.
    assert warm["loaded"] == 0 and (cache / INDUCTOR_DIR / STAMP_FILE).is_file(), warm

    # Only the mega-cache file left (a directory that lost its entries, a copied file): the
    # relaunch loads it (torch.compiler.load_cache_artifacts) and still compiles nothing.
    shutil.rmtree(cache / INDUCTOR_DIR)
    from_file = _relaunch(cache)
    assert from_file["fx_hit"] and from_file["fx_miss"] == 0 and from_file["loaded"], from_file
    assert _relaunch(cache)["loaded"] == 0  # the load stamped inductor/


def test_a_new_artifacts_file_is_loaded_again(tmp_path: Path) -> None:
    cache_dir = tmp_path / "c"
    with CompileCache(cache_dir) as cache:
        cache.artifacts_file.write_bytes(b"v1")
        cache._write_stamp()
        assert cache._stamp_matches()
        cache.artifacts_file.write_bytes(b"v2, a later save")  # another size
        assert not cache._stamp_matches()
        cache.stamp_file.write_bytes(b"\x00 not json")
        assert not cache._stamp_matches()


class _Small(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.a(x)).sum()


def test_an_inprocess_restart_keeps_the_compiled_code(tmp_path: Path) -> None:
    """Each attempt builds a fresh model and compiles it (as the trainer does); the cache is
    opened outside the restartable scope. The second attempt compiles nothing, and its first
    step is not booked as compile in the goodput ledger."""
    seen: list[CompileCounts] = []
    restarter = InProcessRestarter(
        RestartOptions(heartbeat_interval=0.05),
        lambda store: DistributedContext(),
        store=RestartStore.local(),
        say=lambda line: None,
    )

    def train(attempt: Attempt, cache: CompileCache) -> int:
        ledger = GoodputLedger(tmp_path, attempt=attempt.index, print_fn=lambda line: None)
        attempt.on_finalize(lambda: ledger.close("fault"))
        booking = CompileBooking(cache, ledger, enabled=True)
        model = _Small()
        model.compile(backend="eager", dynamic=False)  # Dynamo's code cache, no Inductor
        with ledger.step(attempt.index + 1) as span:
            before = booking.mark()
            model(torch.ones(2, 4)).backward()
            counts = booking.book(span, before)
        seen.append(counts or CompileCounts())
        if attempt.index == 0:
            raise RuntimeError("injected")
        ledger.close()
        return attempt.index

    with CompileCache(tmp_path / "cache") as cache:
        assert restarter.run(lambda attempt: train(attempt, cache)) == 1
    assert seen[0].frames >= 1 and seen[1] == CompileCounts(), seen
    spans = [r for r in read_ledger(tmp_path / "goodput.jsonl").records if isinstance(r, Span)]
    compiles = [
        (s.session.rsplit("-", 2)[1], s.source) for s in spans if s.bucket is Bucket.COMPILE
    ]
    assert compiles == [("0", CompileSource.COLD)], spans  # attempt 0 only: attempt 1 is warm
    assert any(s.bucket is Bucket.PRODUCTIVE and s.session.rsplit("-", 2)[1] == "1" for s in spans)
    assert summarize(read_ledger(tmp_path / "goodput.jsonl")).compile_sources.keys() == {"cold"}


def test_the_cache_directory_must_be_the_users_own(tmp_path: Path) -> None:
    check_cache_dir("--compile-cache-dir", tmp_path / "new" / "cache")  # created later: fine
    own = tmp_path / "own"
    own.mkdir(mode=0o755)
    check_cache_dir("--compile-cache-dir", own)
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(ValueError, match=r"^--compile-cache-dir .*writable by every user"):
        check_cache_dir("--compile-cache-dir", open_dir)
    planted = tmp_path / "planted"
    (planted / INDUCTOR_DIR).mkdir(parents=True)
    (planted / INDUCTOR_DIR).chmod(0o777)
    with pytest.raises(ValueError, match="inductor is writable by every user"):
        check_cache_dir("--compile-cache-dir", planted)
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o775)  # umask 002: a group member could plant code
    with pytest.raises(ValueError, match=r"writable by its group \(mode 775; chmod g-w\)"):
        check_cache_dir("--compile-cache-dir", shared)
    link = tmp_path / "link"
    link.symlink_to(own)
    with pytest.raises(ValueError, match="symbolic link"):
        check_cache_dir("--compile-cache-dir", link)
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ValueError, match="not a directory"):
        check_cache_dir("--compile-cache-dir", afile)
    with pytest.raises(ValueError, match="symbolic link"):
        CompileCache(link)  # a user's loop gets the same check


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="needs chown")
def test_a_cache_directory_of_another_user_is_refused(tmp_path: Path) -> None:
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 4242, 4242)
    with pytest.raises(ValueError, match=r"owned by uid 4242, not by this user"):
        check_cache_dir("--compile-cache-dir", theirs)


def test_open_points_inductor_at_the_cache_and_close_restores(tmp_path: Path) -> None:
    import torch._inductor.config as inductor_config
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    before = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    with inductor_config.patch(fx_graph_cache=False):
        with CompileCache(tmp_path / "c") as cache:
            assert cache_dir() == str(tmp_path / "c" / INDUCTOR_DIR)
            assert inductor_config.fx_graph_cache is True
            assert not cache.save()  # nothing compiled since it opened: nothing written
        assert inductor_config.fx_graph_cache is False  # restored
        assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") == before


def test_a_torn_artifacts_file_starts_cold_without_failing(tmp_path: Path) -> None:
    cache_dir = tmp_path / "c"
    cache_dir.mkdir(mode=0o700)
    (cache_dir / ARTIFACTS_FILE).write_bytes(b"\x00\x01torn")
    with CompileCache(cache_dir) as cache:
        assert cache.load() == 0


def test_a_compiled_graph_is_progress_for_the_inprocess_watchdog() -> None:
    """A cold compile takes longer than --inprocess-soft-timeout (52-72 s at gpt2-124m on an
    H200, the default timeout is 60 s) but completes graph after graph: each one is progress."""
    from stalwart.reliability.inprocess.monitor import AttemptMonitor, MonitorTimes

    store = RestartStore.local()
    times = MonitorTimes(soft_timeout=10.0, hard_timeout=20.0, heartbeat_interval=1.0,
                         heartbeat_timeout=10.0)  # fmt: skip
    monitor = AttemptMonitor(store, 0, times, main_thread_id=1, on_hard_timeout=lambda: None)
    graphs = [0]
    monitor.probe = lambda: None  # the first iteration has not completed
    monitor.activity = lambda: graphs[0]
    monitor._running = True  # as after start(), without the thread
    monitor.reset(0.0)
    for t in (8.0, 16.0, 24.0, 32.0):  # a graph compiled every 8 s: 32 s without an iteration
        graphs[0] += 1
        monitor.tick(t)
    assert store.failure(0) is None
    monitor.tick(43.0)  # then nothing for 11 s: a hang
    assert store.failure(0) is not None


def test_compile_activity_changes_while_torch_compiles() -> None:
    """Inside a compile (here: the backend, called by Dynamo) every read differs, so the
    watchdog sees progress for the whole compile; outside it follows the counters."""
    from stalwart.compile import CompileActivity

    activity = CompileActivity()
    seen: list[object] = []

    def backend(gm: torch.fx.GraphModule, inputs: list[torch.Tensor]) -> object:
        seen.extend([activity.compiling, activity(), activity()])
        return gm.forward

    try:
        fn = torch.compile(lambda x: x * 3 + 1, backend=backend)
        fn(torch.ones(2))
        assert seen[0] is True and seen[1] != seen[2], seen
        assert not activity.compiling and activity() == activity()
    finally:
        activity.close()
    from torch._dynamo.callback import callback_handler

    assert activity._started not in callback_handler.start_callbacks  # removed
