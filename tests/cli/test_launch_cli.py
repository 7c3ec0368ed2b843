"""``stalwart launch`` end to end with a stand-in worker (no torch in the workers: fast): the
torchrun rounds, the devices each round gets, the actions in the ledger and events, the budget,
and the one-line errors. The real trainer under it: tests/distributed/test_launch_torchrun.py."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from stalwart.observability.goodput.reader import read_ledger
from stalwart.observability.goodput.records import format_table, summarize

from train_utils import REPO

WORKER = """
import json, os, socket, sys
save = sys.argv[sys.argv.index("--save") + 1]
rank = int(os.environ["RANK"])
with open(os.path.join(save, f"launches_{rank}.txt"), "a") as f:
    f.write(os.environ.get("STALWART_VISIBLE_DEVICES", "") + " " + os.environ["WORLD_SIZE"] + "\\n")
with open(os.path.join(save, f"launches_{rank}.txt")) as f:
    n = len(f.read().splitlines()) - 1
plan = json.loads(os.environ["FAKE_PLAN"])
step = plan[min(n, len(plan) - 1)]
if rank == 0 and step.get("suspect"):
    with open(os.path.join(save, "suspect_devices.json"), "w") as f:
        json.dump({"suspects": [{"rank": 1, "host": socket.gethostname(),
                                 "device": step["suspect"]}]}, f)
sys.exit(step["codes"].get(str(rank), 0))
"""


def _launch(tmp_path: Path, launch_args: list[str], plan: list[dict[str, object]],
            train_args: list[str] | None = None,
            env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:  # fmt: skip
    (tmp_path / "fakeworker.py").write_text(WORKER)
    save = tmp_path / "save"
    save.mkdir(exist_ok=True)
    env = {**os.environ, "FAKE_PLAN": json.dumps(plan), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO / "src")])}  # fmt: skip
    env.pop("STALWART_VISIBLE_DEVICES", None)
    env.update(env_extra or {})
    cmd = [sys.executable, "-m", "stalwart", "launch", "--module", "fakeworker",
           "--monitor-interval", "0.1", *launch_args, "--", "--save", str(save),
           *(train_args or [])]  # fmt: skip
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=180, cwd=tmp_path)


def _launch_lines(save: Path, rank: int) -> list[str]:
    return (save / f"launches_{rank}.txt").read_text().splitlines()


def _actions(save: Path) -> list[str]:
    return [a.get("action") for a in summarize(read_ledger(save / "goodput.jsonl")).actions]


def _events(save: Path) -> list[str]:
    rows = [json.loads(line) for line in (save / "events.jsonl").read_text().splitlines()]
    return [r["detail"].split(":")[0] for r in rows if r["kind"] == "launch"]


def test_budget_exhausted_exits_with_the_failed_rank_code_and_one_line(tmp_path: Path) -> None:
    proc = _launch(tmp_path, ["--nproc-per-node", "2", "--max-restarts", "1"],
                   [{"codes": {"1": 3}}])  # fmt: skip
    save = tmp_path / "save"
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert len(_launch_lines(save, 0)) == 2  # the first launch and one restart
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("stalwart launch:")]
    assert lines[0].startswith("stalwart launch: restart: rank 1 exited 3")
    assert lines[-1].startswith(
        "stalwart launch: exhausted: restart budget exhausted (--max-restarts): rank 1 exited 3"
    )
    assert _actions(save) == ["restart", "exhausted"] == _events(save)
    table = format_table(summarize(read_ledger(save / "goodput.jsonl")))  # stalwart goodput
    assert "stalwart launch actions" in table and "exhausted  restart budget exhausted" in table


def test_exit_17_with_a_suspect_relaunches_without_it(tmp_path: Path) -> None:
    plan = [{"codes": {"0": 17, "1": 17, "2": 17}, "suspect": "dev-b"}, {"codes": {}}]
    proc = _launch(tmp_path, ["--nproc-per-node", "3", "--devices", "dev-a,dev-b,dev-c"], plan,
                   ["--global-batch-size", "12", "--micro-batch-size", "2"])  # fmt: skip
    save = tmp_path / "save"
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _launch_lines(save, 0) == ["dev-a,dev-b,dev-c 3", "dev-a,dev-c 2"]
    assert _launch_lines(save, 1) == ["dev-a,dev-b,dev-c 3", "dev-a,dev-c 2"]
    assert len(_launch_lines(save, 2)) == 1  # no third rank after the exclusion
    host = socket.gethostname()
    assert (f"exclude: exit 17: suspect device(s) {host}/dev-b: relaunching without them on 2 "
            "rank(s) (dev-a, dev-c), global batch 12 kept: 3 micro-batches per rank") in proc.stderr  # fmt: skip
    assert _actions(save) == ["exclude", "finished"] == _events(save)
    record = summarize(read_ledger(save / "goodput.jsonl")).actions[0]
    assert (record.get("world_size"), record.get("devices")) == (2, "dev-a,dev-c")


def test_exit_16_moves_to_the_spares(tmp_path: Path) -> None:
    plan = [{"codes": {"0": 16, "1": 16}}, {"codes": {}}]
    proc = _launch(tmp_path, ["--devices", "g0,g1,g2,g3", "--nproc-per-node", "2"], plan)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _launch_lines(tmp_path / "save", 0) == ["g0,g1 2", "g2,g3 2"]


SLURM_NODE = "slurm-node-7"  # SLURM's NodeName, unlike any hostname of the test machine


def _scontrol(tmp_path: Path, body: str = "") -> dict[str, str]:
    """A stand-in scontrol that logs its arguments, then runs ``body``; the SLURM job's env."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {calls}\n{body}\n')
    (bin_dir / "scontrol").chmod(0o755)
    return {
        "SLURM_JOB_ID": "77",
        "SLURMD_NODENAME": SLURM_NODE,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
    }


def _calls(tmp_path: Path) -> list[str]:
    calls = tmp_path / "scontrol.calls"
    return calls.read_text().splitlines() if calls.exists() else []


@pytest.mark.parametrize("run_it", [False, True])
def test_exit_16_without_spares_under_slurm_moves_the_job_off_slurm_s_node_name(
    tmp_path: Path, run_it: bool
) -> None:
    proc = _launch(
        tmp_path,
        ["--nproc-per-node", "2", *(["--slurm-requeue"] if run_it else [])],
        [{"codes": {"0": 16, "1": 16}}],
        env_extra=_scontrol(tmp_path),
    )
    assert proc.returncode == 16, proc.stderr[-3000:]
    # SLURM's node name, not the hostname: ExcNodeList takes only names SLURM knows.
    assert socket.gethostname() != SLURM_NODE
    assert (
        f"requeue: exit 16 (resume on other hardware): move SLURM job 77 off node(s) {SLURM_NODE}"
        in proc.stderr
    )
    if run_it:
        assert _calls(tmp_path) == [f"update JobId=77 ExcNodeList={SLURM_NODE}", "requeue 77"]
    else:
        assert not _calls(tmp_path)
        assert (
            f"to move the job, run: scontrol update JobId=77 ExcNodeList={SLURM_NODE}"
            in proc.stderr
        )
    assert len(_launch_lines(tmp_path / "save", 0)) == 1


def _own_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("stalwart launch:")]


def test_slurm_requeue_without_scontrol_is_one_line_and_keeps_the_verdict_code(
    tmp_path: Path,
) -> None:
    env = _scontrol(tmp_path)
    no_scontrol = [
        d for d in os.environ["PATH"].split(os.pathsep) if d and not Path(d, "scontrol").exists()
    ]
    env["PATH"] = os.pathsep.join([str(tmp_path / "empty"), *no_scontrol])
    proc = _launch(tmp_path, ["--nproc-per-node", "2", "--slurm-requeue"],
                   [{"codes": {"0": 16, "1": 16}}], env_extra=env)  # fmt: skip
    assert proc.returncode == 16, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert _own_lines(proc.stderr)[-1] == (
        f"stalwart launch: scontrol update JobId=77 ExcNodeList={SLURM_NODE}: scontrol is not on "
        f"PATH; the job stays: run scontrol update JobId=77 ExcNodeList={SLURM_NODE}; scontrol "
        "requeue 77 by hand"
    )


@pytest.mark.parametrize(
    ("body", "said"),
    [
        (
            'echo "slurm_update error: Invalid node name specified" >&2; exit 1',
            "exited 1 (slurm_update error: Invalid node name specified)",
        ),
        ("kill -KILL $$", "exited -9"),
    ],
)
def test_slurm_requeue_with_a_failing_scontrol_is_one_line_and_stops_there(
    tmp_path: Path, body: str, said: str
) -> None:
    proc = _launch(
        tmp_path,
        ["--nproc-per-node", "2", "--slurm-requeue"],
        [{"codes": {"0": 16, "1": 16}}],
        env_extra=_scontrol(tmp_path, body),
    )
    assert proc.returncode == 16, proc.stderr[-3000:]
    assert _calls(tmp_path) == [f"update JobId=77 ExcNodeList={SLURM_NODE}"]  # no requeue after it
    line = _own_lines(proc.stderr)[-1]
    assert line.startswith(
        f"stalwart launch: scontrol update JobId=77 ExcNodeList={SLURM_NODE}: {said}; the job stays"
    )
    assert "Invalid node name" not in proc.stderr.replace(line, "")  # scontrol's words once: ours


def test_bad_input_exit_2_is_not_relaunched(tmp_path: Path) -> None:
    proc = _launch(tmp_path, ["--nproc-per-node", "2"], [{"codes": {"0": 2, "1": 2}}])
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(_launch_lines(tmp_path / "save", 0)) == 1
    assert "stalwart launch: bad_input: rank 0 exited 2" in proc.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [(["--max-restarts", "-1", "--", "--save", "s"],
      "argument --max-restarts/--max_restarts: must be an integer >= 0, got '-1'"),
     (["--max-restarts", "20000", "--", "--save", "s"],
      "--max-restarts (the restart budget) must be in [0, 10000], got 20000"),
     (["--max-restarts", "x", "--", "--save", "s"],
      "argument --max-restarts/--max_restarts: expected an integer"),
     (["--max-restart", "3", "--", "--save", "s"], "torchrun option: unrecognized arguments"),
     (["--", "--train-iters", "3"], "the train args need --save DIR"),
     (["--nproc-per-node", "2"], "put the train args after --"),
     (["--devices", "a,a", "--", "--save", "s"], "--devices names a device twice"),
     (["--fork-workers", "--module", "mine", "--", "--save", "s"],
      "--fork-workers runs `stalwart train` in the forked workers: it needs --module stalwart"),
     (["--devices", "a", "--nproc-per-node", "2", "--", "--save", "s"],
      "--nproc-per-node must be between 1 and the 1 device(s) of --devices, got 2")],
)  # fmt: skip
def test_bad_launch_options_are_one_line_and_exit_2(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalwart.cli.main import main

    assert main(["launch", *args]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("stalwart launch: error: ") and message in err


def test_help_lists_the_policy() -> None:
    from stalwart.cli.launch import build_parser

    text = build_parser().format_help()
    for needle in ("--max-restarts", "--devices", "--slurm-requeue", "--fork-workers", "exit 16 (resume on other",
                   "relaunch without the suspect devices", "scontrol requeue"):  # fmt: skip
        assert needle in text


def test_config_file_train_args_set_save_run_dir_and_batch_and_the_ledger_is_the_trainer_s(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from stalwart.cli.launch import build_plan, record_launch_action
    from stalwart.distributed.launch import RoundResult, run_launches
    from stalwart.observability.run_dir import run_dir_for

    save, run_dir = tmp_path / "ckpt", tmp_path / "runs" / "a"
    run_dir.mkdir(parents=True)
    config = tmp_path / "run.toml"
    config.write_text(
        f'save = "{save}"\nrun_dir = "{run_dir}"\n[training]\nglobal_batch_size = 12\n'
        "micro_batch_size = 2\nuse_cpu = true\n"
    )
    train_args = ["--config", str(config), "--preset", "tiny"]
    plan = build_plan(["--nproc-per-node", "3", "--devices", "a,b,c", "--", *train_args])
    assert (plan.save, plan.run_dir) == (str(save), str(run_dir))
    assert (plan.global_batch_size, plan.micro_batch_size) == (12, 2)
    assert plan.device_env == "STALWART_VISIBLE_DEVICES"  # use_cpu from the file
    # The trainer's own reading of the same args: the same run directory.
    from stalwart.cli.args import parse_train_args
    from stalwart.config.run import build_run_config

    trainer = build_run_config(parse_train_args(train_args), train_args)
    assert run_dir_for(trainer.checkpoint.save, trainer.shell.run_dir) == plan.run_dir
    save.mkdir()
    (save / "suspect_devices.json").write_text(
        json.dumps({"suspects": [{"host": plan.host, "device": "b"}]})
    )
    for name in ("STALWART_VISIBLE_DEVICES", "STALWART_LAUNCH_ROUND"):  # each round sets them:
        monkeypatch.setenv(name, "")  # restored (unset) after the test, for the tests after it
    rounds = iter([RoundResult({0: 17, 1: 17, 2: 17}), RoundResult({0: 0})])
    assert run_launches(plan, record_launch_action, lambda argv, worker: next(rounds)) == 0
    assert _actions(run_dir) == ["exclude", "finished"] == _events(run_dir)  # the batch was known
    assert not (save / "goodput.jsonl").exists()


def test_the_command_line_wins_over_the_config_file(tmp_path: Path) -> None:
    from stalwart.cli.launch import build_plan

    config = tmp_path / "run.toml"
    config.write_text('save = "from-file"\nglobal_batch_size = 12\nuse_cpu = true\n')
    plan = build_plan(
        [
            "--devices",
            "a",
            "--",
            "--config",
            str(config),
            "--save",
            "cli",
            "--global-batch-size",
            "24",
        ]
    )
    assert (plan.save, plan.run_dir, plan.global_batch_size) == ("cli", "cli", 24)


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "--config: file not found: "),
        (b"save = [unclosed", "--config: cannot read "),
        (b"\x00\xff\xfe binary", "--config: cannot read "),
        (b'sav = "x"\n', "unknown key 'sav' (keys are flag names)"),
        (b"global_batch_size = -4\n", "key 'global_batch_size': "),
        (b"train_iters = 3\n", "the train args need --save DIR (or save in their --config file)"),
    ],
)
def test_a_bad_config_file_in_the_train_args_is_one_line_and_exit_2(
    tmp_path: Path, content: bytes | None, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from stalwart.cli.main import main

    config = tmp_path / "run.toml"
    if content is not None:
        config.write_bytes(content)
    assert main(["launch", "--", "--config", str(config), "--use-cpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("stalwart launch: error: ") and message in err, err


@pytest.mark.parametrize(
    ("env", "message"),
    [
        (
            {"SLURMD_NODENAME": "bad node"},
            "environment variable SLURMD_NODENAME='bad node': must be",
        ),
        ({"SLURM_JOB_ID": "77"}, "--slurm-requeue needs $SLURMD_NODENAME"),
        (
            {"SLURMD_NODENAME": "n1"},
            "--slurm-requeue runs scontrol for the SLURM job: $SLURM_JOB_ID is not set",
        ),
    ],
)
def test_slurm_environment_problems_are_one_line_at_the_start(
    env: dict[str, str],
    message: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stalwart.cli.main import main

    for name in ("SLURM_JOB_ID", "SLURM_JOBID", "SLURMD_NODENAME"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["launch", "--slurm-requeue", "--", "--save", "s", "--use-cpu"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("stalwart launch: error: ") and message in err, err
