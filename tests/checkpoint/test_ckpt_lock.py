"""One job per save directory: the lock of `stalwart.checkpoint.lock` and the manager's use of it."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from ckpt_fixtures import make_model, make_optimizer, train_steps

from stalwart.checkpoint import CheckpointManager, layout
from stalwart.cli.main import main

from train_utils import TINY_FLAGS

LOCK_FILENAME = ".stalwart.lock"
HOLDER = (
    "import sys, time\n"
    "from stalwart.checkpoint.lock import SaveDirLock\n"
    "lock = SaveDirLock(sys.argv[1], flag='--save', heartbeat_s=0.2)\n"
    "lock.acquire()\n"
    "print('HELD', flush=True)\n"
    "time.sleep(120)\n"
)


@pytest.fixture
def holder(tmp_path: Path):
    """Another process (another job) holding the lock of ``tmp_path / 'save'``."""
    save = tmp_path / "save"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(save)], stdout=subprocess.PIPE,
                            text=True, env={**env, "STALWART_JOB_ID": "job-a"})  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD"
    yield save, proc
    proc.kill()
    proc.wait()


def test_second_job_is_refused_in_one_line_and_deletes_nothing(holder, capsys) -> None:
    save, proc = holder
    partial = save / layout.tmp_dir_name(8, "job-a-writing")
    partial.mkdir()
    code = main(["train", *TINY_FLAGS, "--train-iters", "2", "--save", str(save)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("stalwart train: error: --save "), err
    assert f"in use by another job (host {socket.gethostname()}, pid {proc.pid}" in err[0]
    assert "job-a" in err[0] and "since" in err[0] and LOCK_FILENAME in err[0]
    assert partial.is_dir()  # the other job's in-progress save is untouched
    assert not list(save.glob("iter_*[0-9]"))


def test_a_sigkilled_holder_is_stale_and_taken_over(holder) -> None:
    from stalwart.checkpoint.lock import SaveDirLock

    save, proc = holder
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert (save / LOCK_FILENAME).exists()  # SIGKILL left it behind
    lock = SaveDirLock(str(save), flag="--save")
    lock.acquire()  # same host, dead pid: stale
    record = json.loads((save / LOCK_FILENAME).read_text())
    assert record["pid"] == os.getpid()
    lock.release()
    assert not (save / LOCK_FILENAME).exists()


def test_a_sigkilled_holder_nobody_reaped_yet_is_stale_and_taken_over(holder) -> None:
    """A zombie (killed, its parent not waiting for it yet: a launcher killed with its workers,
    an init that reaps late) holds nothing: the next job takes the lock over at once."""
    from stalwart.checkpoint.lock import SaveDirLock

    save, proc = holder
    proc.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while _state(proc.pid) != "Z" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _state(proc.pid) == "Z"  # not reaped: os.kill(pid, 0) still succeeds
    lock = SaveDirLock(str(save), flag="--save")
    lock.acquire()
    assert json.loads((save / LOCK_FILENAME).read_text())["pid"] == os.getpid()
    lock.release()


def _state(pid: int) -> str:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat[stat.rindex(")") + 2]


def _foreign(save: Path, **fields: object) -> None:
    save.mkdir(parents=True, exist_ok=True)
    record = {"host": "other-node", "pid": 4242, "job": None, "token": "t",
              "since": time.time() - 100, "heartbeat": time.time(), **fields}  # fmt: skip
    (save / LOCK_FILENAME).write_text(json.dumps(record))


def test_heartbeat_decides_for_a_holder_on_another_host(tmp_path: Path) -> None:
    from stalwart.checkpoint.lock import SaveDirLock

    save = tmp_path / "save"
    _foreign(save)
    with pytest.raises(ValueError, match="host other-node, pid 4242"):
        SaveDirLock(str(save), flag="--save", job_id="me").acquire()
    _foreign(save, heartbeat=time.time() - 3600)  # its node died an hour ago
    lock = SaveDirLock(str(save), flag="--save", job_id="me")
    lock.acquire()
    lock.release()


def test_the_same_job_takes_its_lock_back_once_it_goes_stale(tmp_path: Path, monkeypatch) -> None:
    """A torchrun restart on another node: the new rank 0 is another process of the same job
    (same TORCHELASTIC_RUN_ID); the killed attempt's heartbeat is still fresh, so it waits
    until the record has stayed unchanged for the staleness bound, then takes it over."""
    from stalwart.checkpoint.lock import SaveDirLock

    save = tmp_path / "save"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run-42")
    monkeypatch.delenv("STALWART_JOB_ID", raising=False)
    _foreign(save, job="TORCHELASTIC_RUN_ID=run-42")
    lock = SaveDirLock(str(save), flag="--save", stale_s=1.0)
    started = time.monotonic()
    lock.acquire()
    assert time.monotonic() - started >= 0.9  # a fresh heartbeat is never taken at once
    lock.release()
    _foreign(save, job="TORCHELASTIC_RUN_ID=run-42", heartbeat=time.time() + 3600)  # skewed clock
    lock = SaveDirLock(str(save), flag="--save", stale_s=1.0)
    lock.acquire()  # unchanged for stale_s of watching: taken, whatever the clocks say
    lock.release()
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's default id identifies nobody
    _foreign(save, job="TORCHELASTIC_RUN_ID=none")
    with pytest.raises(ValueError, match="in use by another job"):
        SaveDirLock(str(save), flag="--save").acquire()


def _beating_holder(save: Path, job: str, other_namespace: bool) -> subprocess.Popen:
    """A live process beating every 0.2 s on the lock of ``save`` as job ``job``; with
    ``other_namespace`` it records another PID namespace and a pid that is dead here (a
    container with the same host name)."""
    fake = (
        "import os\n"
        "from stalwart.checkpoint import lock as m\n"
        "real = m._process_identity\n"
        "m._process_identity = lambda: {**real(), 'pidns': 'pid:[4242]'}\n"
        "m.os.getpid = lambda: 4194999\n"  # above pid_max: no such process here
    )
    script = (fake if other_namespace else "") + HOLDER
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID")}
    proc = subprocess.Popen([sys.executable, "-c", script, str(save)], stdout=subprocess.PIPE,
                            text=True, env={**env, "STALWART_JOB_ID": job})  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline().strip() == "HELD"
    return proc


@pytest.mark.parametrize("case", ["other-pid-namespace", "same-job-step-relaunch"])
def test_a_fresh_heartbeat_wins_over_the_pid_check_and_the_job_id(
    tmp_path: Path, monkeypatch, case: str
) -> None:
    """Issue 29, item 4: a live holder in a container with the same host name (its pid looks
    dead here), or a second SLURM step of the same job while the first still runs: refused."""
    from stalwart.checkpoint.lock import SaveDirLock

    save = tmp_path / "save"
    proc = _beating_holder(save, "job-a", other_namespace=case == "other-pid-namespace")
    try:
        job = "job-b" if case == "other-pid-namespace" else "STALWART_JOB_ID=job-a"
        before = json.loads((save / LOCK_FILENAME).read_text())
        with pytest.raises(ValueError, match="in use by another job"):
            SaveDirLock(str(save), flag="--save", job_id=job, stale_s=30.0).acquire()
        after = json.loads((save / LOCK_FILENAME).read_text())
        assert after["token"] == before["token"]  # the holder still holds it
    finally:
        proc.kill()
        proc.wait()


def test_in_process_restart_reacquires_the_lock(tmp_path: Path) -> None:
    first = CheckpointManager(str(tmp_path))
    first.check_writable()
    first.close(abort=True)  # an in-process restart throws the manager away
    assert not (tmp_path / LOCK_FILENAME).exists()
    second = CheckpointManager(str(tmp_path))
    second.check_writable()
    again = CheckpointManager(str(tmp_path))  # the same process: its own lock, not a second job
    again.check_writable()
    again.close()
    second.close()


def test_a_lock_lost_to_another_job_stops_writes(tmp_path: Path) -> None:
    from stalwart.checkpoint.lock import SaveDirLock

    lock = SaveDirLock(str(tmp_path), flag="--save", heartbeat_s=0.05)
    lock.acquire()
    _foreign(tmp_path)  # another job broke in (this one looked dead to it, e.g. frozen)
    deadline = time.monotonic() + 5
    while lock._lost is None and time.monotonic() < deadline:
        time.sleep(0.05)
    with pytest.raises(Exception, match=r"lost its lock.*host other-node, pid 4242"):
        lock.check_held()
    lock.release()
    assert (tmp_path / LOCK_FILENAME).exists()  # never deletes someone else's lock

    model = make_model()
    opt = make_optimizer(model)
    train_steps(model, opt, 1)
    manager = CheckpointManager(str(tmp_path / "m"))
    manager.check_writable()
    manager._locks.locks[0]._lost = "host other-node, pid 4242"  # what the heartbeat found
    with pytest.raises(Exception, match="lost its lock"):
        manager.save(1, model, opt, {}, {})
    assert not list((tmp_path / "m").glob("iter_*"))
    manager.close()


def test_released_when_training_raises(tmp_path: Path) -> None:
    from stalwart.distributed.process_group import DistributedContext
    from stalwart.train.trainer import Trainer

    from train_utils import make_config

    save = tmp_path / "save"
    with (
        pytest.raises(RuntimeError, match="boom"),
        Trainer(
            make_config("--train-iters", "2", "--save", str(save)), DistributedContext()
        ) as trainer,
    ):
        assert (save / LOCK_FILENAME).exists()
        trainer.checkpointer.manager._locks.check_held()
        raise RuntimeError("boom")
    assert not (save / LOCK_FILENAME).exists()


def test_release_survives_any_os_error(tmp_path: Path, monkeypatch, caplog) -> None:
    """A --save that turned read-only (remounted, immutable) under a running job: the release
    warns and the job's own error stays the one line it prints (issue 29, item 6)."""
    import errno

    from stalwart.checkpoint.lock import SaveDirLock

    lock = SaveDirLock(str(tmp_path), flag="--save")
    lock.acquire()

    def read_only(path: str, *args: object, **kwargs: object) -> None:
        raise OSError(errno.EROFS, "Read-only file system", path)

    monkeypatch.setattr(os, "unlink", read_only)
    lock.release()
    assert "could not remove the lock" in caplog.text and "Read-only file system" in caplog.text


def _chattr(flag: str, path: Path) -> bool:
    try:
        return subprocess.run(["chattr", flag, str(path)], capture_output=True).returncode == 0
    except OSError:
        return False


def test_a_save_dir_made_immutable_under_the_job_is_one_line_and_exit_2(
    tmp_path: Path, monkeypatch, capsys
) -> None:
    from stalwart.checkpoint import lock as lock_module

    save = tmp_path / "save"
    save.mkdir()
    if not _chattr("+i", save) or not _chattr("-i", save):
        pytest.skip("chattr +i needs root on a filesystem with the immutable flag")
    acquire = lock_module.SaveDirLock.acquire

    def acquire_then_freeze(self: lock_module.SaveDirLock) -> None:
        acquire(self)
        _chattr("+i", save)  # the directory turns immutable once the job holds its lock

    monkeypatch.setattr(lock_module.SaveDirLock, "acquire", acquire_then_freeze)
    try:
        code = main(["train", *TINY_FLAGS, "--train-iters", "4", "--save", str(save),
                     "--save-interval", "2"])  # fmt: skip
    finally:
        _chattr("-i", save)
    err = [line for line in capsys.readouterr().err.splitlines() if "WARNING" not in line]
    assert code == 2
    assert len(err) == 1 and err[0].startswith("stalwart train: "), err
    assert "Operation not permitted" in err[0] and str(save) in err[0]
