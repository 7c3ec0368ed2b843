"""The fault-schedule scenario (``stalwart chaos --fault-schedule``): one long job under
``stalwart launch`` on 2 gloo ranks with fake devices ``dev-a,dev-b``, one fault every
``iterations / 6`` iterations, each kind once, no person in the loop:

1. ``hang``: rank 0 sleeps in its step (``--inject-fault hang``); its watchdog kills it after
   the ``step`` timeout; ``stalwart launch``: restart;
2. ``sigkill``: the harness SIGKILLs rank 1's worker; restart;
3. ``transient_nan``: rank 1's loss observed as NaN once (``transient_error``,
   ``--error-injection-once``): the in-place rerun is clean, exit 17 without suspects; restart
   (``transient_policy="continue"``, ``--rerun-transient-policy continue`` on every launch: the
   step applies the rerun's result and training goes on, no launch action: one replay);
4. ``sigterm``: the harness SIGTERMs the launcher (a preemption): the workers save and stop, the
   launcher exits 143 (``preempted``), and the harness, as a scheduler would, relaunches;
5. ``persistent_device``: device ``dev-b`` makes rank 1's loss NaN on every run
   (``persistent_error --error-injection-devices dev-b``): peer replay diagnoses it, exit 17 with
   ``suspect_devices.json``; ``stalwart launch``: exclude, 1 rank on ``dev-a``, the global batch
   kept (1 -> 2 micro-batches per rank), the 2-rank DCP checkpoint resumed by 1 rank.

The rerun injector takes one kind per launch, so the relaunch after the SIGTERM (the scheduler's)
carries the persistent fault's flags instead of the transient's (both fire once). The reference
is the fault-free job with the same world-size change: 2 ranks to the checkpoint the exclusion
resumed, 1 rank from there; the final weights must be bitwise equal. It runs on 2 ranks to fit a
2-core machine: 3 or more would resume bitwise too, since DDP's bucket layout is settled before
the first iteration (`stalwart.distributed.ddp_layout`). Goodput comes from the job's ledger
(``goodput.jsonl``), which also holds every action of ``stalwart launch``, and so does the lost
work per fault: the iterations the next session recomputed (the last one the faulted session
completed, less the one the next session resumed from) and their seconds.

With ``non_persistent_interval`` (``--non-persistent-save-interval``) the job also saves
non-persistent checkpoints of ``non_persistent_type``: ``local`` copies go to
``<work>/job/local`` on two fake nodes (``STALWART_FAKE_NODE_SIZE=1``: a node per rank) with
``--replication``, so the exclusion's one rank finds both ranks' shards on its node.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stalwart.chaos.runner import Job, LaunchResult, LaunchSpec, finish
from stalwart.checkpoint.local_layout import FAKE_NODE_ENV

DEVICES = ("dev-a", "dev-b")
EXPECTED_ACTIONS = ["restart", "restart", "restart", "preempted", "exclude", "finished"]
HANG_STEP_TIMEOUT_S = 3.0
FT_FLAGS = [
    "--enable-ft",
    "--ft-num-warmup-iters",
    "2",
    "--ft-timeouts",
    f"setup=180,step={HANG_STEP_TIMEOUT_S:g},checkpointing=180,out_of_section=180",
]
MODEL_FLAGS = [
    "--preset",
    "tiny",
    "--num-layers",
    "1",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "2",
    "--seq-length",
    "32",
    "--vocab-size",
    "512",
    "--micro-batch-size",
    "4",
    "--global-batch-size",
    "8",
    "--lr",
    "1e-3",
    "--lr-warmup-iters",
    "2",
    "--no-progress-bar",
    "--use-cpu",
]


@dataclass(frozen=True)
class ScheduleConfig:
    """The job: ``iterations`` (a fault every ``iterations // 6``), ``save_interval``."""

    work_dir: Path
    iterations: int
    save_interval: int
    seed: int = 0
    timeout: float = 3600.0  # seconds per stalwart launch invocation
    log_interval: int = 50
    fork_workers: bool = False  # stalwart launch --fork-workers: relaunches skip the imports
    non_persistent_interval: int = 0  # --non-persistent-save-interval (0: none)
    non_persistent_type: str = "global"  # --non-persistent-ckpt-type: global or local
    transient_policy: str = "exit"  # --rerun-transient-policy of every launch: exit or continue


@dataclass(frozen=True)
class ScheduledFault:
    kind: str
    iteration: int  # as logged: the fault strikes while this iteration runs
    rank: int


def schedule(iterations: int) -> list[ScheduledFault]:
    """The five faults, evenly spaced (pure)."""
    step = iterations // 6
    kinds = (
        ("hang", 0),
        ("sigkill", 1),
        ("transient_nan", 1),
        ("sigterm", 0),
        ("persistent_device", 1),
    )
    return [ScheduledFault(kind, step * (i + 1), rank) for i, (kind, rank) in enumerate(kinds)]


def expected_actions(transient_policy: str) -> list[str]:
    """The launch actions the ledger must hold, in order (pure): one per fault that ends a
    launch, then ``finished``; under ``continue`` the transient fault ends none."""
    if transient_policy == "continue":
        return [a for i, a in enumerate(EXPECTED_ACTIONS) if i != 2]
    return list(EXPECTED_ACTIONS)


def _ends_a_launch(kind: str, transient_policy: str) -> bool:
    return not (kind == "transient_nan" and transient_policy == "continue")


def check_shape(iterations: int, save_interval: int) -> None:
    """ValueError naming the flag unless every fault has a checkpoint before it."""
    if save_interval < 1 or iterations < 12 * save_interval:
        raise ValueError(
            f"--iterations ({iterations}) must be at least 12 x --save-interval ({save_interval}) "
            "for --fault-schedule: every fault needs two checkpoints before it"
        )


@dataclass
class ScheduleResult:
    """What the scenario measured (``to_json`` is ``stalwart chaos --json``'s content)."""

    passed: bool = False
    problems: list[str] = field(default_factory=list)
    faults: list[dict[str, Any]] = field(default_factory=list)
    actions: list[dict[str, Any]] = field(default_factory=list)
    goodput: dict[str, Any] = field(default_factory=dict)
    bitwise_equal: bool | None = None
    wall_seconds: float = 0.0
    reference_seconds: float = 0.0
    commands: list[str] = field(default_factory=list)

    def check(self, ok: bool, problem: str) -> None:
        if not ok:
            self.problems.append(problem)

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": "fault_schedule",
            "passed": self.passed,
            "problems": self.problems,
            "faults": self.faults,
            "actions": self.actions,
            "goodput": self.goodput,
            "bitwise_equal": self.bitwise_equal,
            "wall_seconds": round(self.wall_seconds, 1),
            "reference_seconds": round(self.reference_seconds, 1),
            "commands": self.commands,
        }


def _launcher(
    config: ScheduleConfig, nproc: int, devices: tuple[str, ...], max_restarts: int
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "stalwart",
        "launch",
        "--nproc-per-node",
        str(nproc),
        "--devices",
        ",".join(devices),
        "--max-restarts",
        str(max_restarts),
        "--monitor-interval",
        "0.2",
        *(["--fork-workers"] if config.fork_workers else []),
        "--",
    ]


def _base(config: ScheduleConfig, save: Path) -> list[str]:
    return [
        *MODEL_FLAGS,
        "--train-iters",
        str(config.iterations),
        "--seed",
        str(config.seed + 1),
        "--save-interval",
        str(config.save_interval),
        "--log-interval",
        str(config.log_interval),
        "--save",
        str(save),
    ]


def _non_persistent(config: ScheduleConfig, job: Path) -> tuple[list[str], dict[str, str]]:
    """The faulted job's non-persistent flags and environment (none without an interval)."""
    if not config.non_persistent_interval:
        return [], {}
    flags = [
        "--non-persistent-save-interval",
        str(config.non_persistent_interval),
        "--non-persistent-ckpt-type",
        config.non_persistent_type,
    ]
    if config.non_persistent_type != "local":
        return flags, {}
    local = ["--non-persistent-local-ckpt-dir", str(job / "local"), "--replication"]
    return [*flags, *local], {FAKE_NODE_ENV: "1"}


def _policy(config: ScheduleConfig) -> list[str]:
    """The faulted job's transient policy (every launch: a job keeps its flags)."""
    if config.transient_policy == "exit":
        return []  # the default: the command lines stay those of the runs before the option
    return ["--rerun-transient-policy", config.transient_policy]


def _injection(fault: ScheduledFault, devices: str | None = None) -> list[str]:
    kind = "persistent_error" if fault.kind == "persistent_device" else "transient_error"
    where = (
        ["--error-injection-devices", devices]
        if devices
        else ["--error-injection-ranks", str(fault.rank)]
    )
    return [
        "--error-injection-rate",
        "1",
        "--error-injection-type",
        kind,
        "--error-injection-iterations",
        str(fault.iteration),
        "--error-injection-once",
        *where,
    ]


def _wait_iteration(job: Job, iteration: int, since: int, timeout: float) -> bool:
    """Wait for the first training-log line of ``iteration`` or later after line ``since``."""
    from stalwart.chaos.runner import ITERATION_RE

    def reached() -> bool:
        return any(
            (m := ITERATION_RE.search(line)) and int(m.group(1)) >= iteration
            for _, line in job.lines[since:]
        )

    return job.wait_for(reached, timeout)


def run_schedule(config: ScheduleConfig, say: Any = print) -> ScheduleResult:
    """Run the faulted job, then the reference; compare; read the ledger."""
    res = ScheduleResult()
    faults = {f.kind: f for f in schedule(config.iterations)}
    save = config.work_dir / "job" / "ckpt"
    started = time.time()
    first = _first_launch(config, res, faults, save, say)
    extra, env = _non_persistent(config, save.parent)
    extra += _policy(config)
    second_args = [
        *_base(config, save),
        *extra,
        "--exit-signal-handler",
        *FT_FLAGS,
        *_injection(faults["persistent_device"], devices="dev-b"),
    ]
    spec = LaunchSpec(
        second_args,
        2,
        launcher=_launcher(config, 2, DEVICES, 4),
        env={"OMP_NUM_THREADS": "1", **env},
    )
    res.commands.append(" ".join([*(spec.launcher or []), *second_args]))
    say(f"chaos schedule: relaunch after the SIGTERM (as a scheduler would), {save}")
    second = finish(Job(spec, config.work_dir / "job" / "2-relaunch.log"), config.timeout)
    res.wall_seconds = time.time() - started
    res.check(
        first.code == 128 + signal.SIGTERM, f"first stalwart launch exited {first.code}, not 143"
    )
    res.check(second.code == 0, f"the relaunch exited {second.code}, not 0")
    _read_ledger(res, save, faults, config.transient_policy)
    _reference_and_compare(config, res, save, faults["persistent_device"].iteration - 1, say)
    res.passed = not res.problems
    return res


def _first_launch(
    config: ScheduleConfig,
    res: ScheduleResult,
    faults: dict[str, ScheduledFault],
    save: Path,
    say: Any,
) -> LaunchResult:
    hang = faults["hang"]
    extra, env = _non_persistent(config, save.parent)
    extra += _policy(config)
    args = [
        *_base(config, save),
        *extra,
        "--exit-signal-handler",
        *FT_FLAGS,
        "--inject-fault",
        "hang",
        "--inject-fault-iteration",
        str(hang.iteration),
        "--inject-fault-rank",
        str(hang.rank),
        *_injection(faults["transient_nan"]),
    ]
    spec = LaunchSpec(
        args, 2, launcher=_launcher(config, 2, DEVICES, 4), env={"OMP_NUM_THREADS": "1", **env}
    )
    res.commands.append(" ".join([*(spec.launcher or []), *args]))
    say(
        f"chaos schedule: {config.iterations} iterations, faults at "
        + ", ".join(f"{f.kind}@{f.iteration}" for f in faults.values())
    )
    job = Job(spec, config.work_dir / "job" / "1-launch.log")
    kill, term = faults["sigkill"], faults["sigterm"]
    if _wait_iteration(job, kill.iteration, 0, config.timeout):
        pid = job.worker_pid(kill.rank)
        say(f"chaos schedule: SIGKILL rank {kill.rank} (pid {pid}) at iteration {kill.iteration}")
        if pid is not None:
            os.kill(pid, signal.SIGKILL)
        res.faults.append({"kind": "sigkill", "iteration": kill.iteration, "at": time.time()})
    mark = len(job.lines)
    if _wait_iteration(job, term.iteration, mark, config.timeout):
        say(f"chaos schedule: SIGTERM to stalwart launch at iteration {term.iteration}")
        os.kill(job.proc.pid, signal.SIGTERM)
        res.faults.append({"kind": "sigterm", "iteration": term.iteration, "at": time.time()})
    return finish(job, config.timeout)


def _read_ledger(
    res: ScheduleResult, save: Path, faults: dict[str, ScheduledFault], transient_policy: str
) -> None:
    from stalwart.observability.goodput.reader import read_ledger
    from stalwart.observability.goodput.records import summarize

    ledger = read_ledger(save / "goodput.jsonl")
    summary = summarize(ledger)
    res.goodput = summary.to_json()
    res.goodput.pop("sessions", None)
    res.actions = [
        {"t": a.t, "action": a.get("action"), "detail": a.get("detail")} for a in summary.actions
    ]
    kinds = [a["action"] for a in res.actions]
    expected = expected_actions(transient_policy)
    res.check(kinds == expected, f"launch actions {kinds}, expected {expected}")
    listed = {f["kind"] for f in res.faults}
    for planned in faults.values():
        if planned.kind not in listed:
            res.faults.append({"kind": planned.kind, "iteration": planned.iteration})
    order = list(faults)
    res.faults.sort(key=lambda f: order.index(f["kind"]))
    ending = [f for f in res.faults if _ends_a_launch(f["kind"], transient_policy)]
    for row, action in zip(ending, res.actions, strict=False):
        row["action"] = action["action"]
        row["detail"] = action["detail"]
    for row in res.faults:
        if not _ends_a_launch(row["kind"], transient_policy):
            row.update(in_place_fault(row["iteration"], ledger.records))
    _lost_work(res, ending, summary.sessions, ledger.records)


def in_place_fault(iteration: int, records: list[Any]) -> dict[str, Any]:
    """A fault the job recovered from without a relaunch (pure): the seconds of the rerun
    spans of ``iteration`` (the ledger's ``it`` is the iteration completed before it) and no
    recomputed work."""
    from stalwart.observability.goodput.records import Bucket, Span

    rerun = sum(
        r.seconds
        for r in records
        if isinstance(r, Span) and r.bucket is Bucket.RERUN and r.iteration == iteration - 1
    )
    return {
        "action": "continue",
        "detail": "the rerun's result applied: one replay, no restart",
        "recomputed": 0,
        "lost_work_s": 0.0,
        "rerun_s": round(rerun, 3),
    }


def lost_work_per_fault(sessions: list[Any], records: list[Any]) -> list[dict[str, Any]]:
    """Per gap between two sessions of the ledger (pure): the iterations the later one
    recomputed (what the earlier completed, less what the later resumed from) and the seconds
    of its lost-work spans."""
    from stalwart.observability.goodput.records import Bucket, Span

    seconds: dict[str, float] = {}
    for record in records:
        if isinstance(record, Span) and record.bucket is Bucket.LOST_WORK:
            seconds[record.session] = seconds.get(record.session, 0.0) + record.seconds
    gaps = []
    for before, after in itertools.pairwise(sessions):
        done = before.last_iteration or 0
        recomputed = max(0, done - (after.resumed_at or 0))
        gaps.append(
            {
                "completed": done,
                "resumed_at": after.resumed_at or 0,
                "recomputed": recomputed,
                "lost_work_s": round(seconds.get(after.session, 0.0), 3),
            }
        )
    return gaps


def _lost_work(
    res: ScheduleResult, ending: list[dict[str, Any]], sessions: list[Any], records: list[Any]
) -> None:
    """Each fault that ended a launch gets the gap after its session."""
    gaps = lost_work_per_fault(sessions, records)
    res.check(
        len(gaps) == len(ending),
        f"{len(sessions)} sessions in the ledger, expected {len(ending) + 1}",
    )
    for row, gap in zip(ending, gaps, strict=False):
        row.update(gap)


def _reference_and_compare(
    config: ScheduleConfig, res: ScheduleResult, save: Path, switch: int, say: Any
) -> None:
    from stalwart.chaos.compare import params_equal
    from stalwart.checkpoint import layout

    ref = config.work_dir / "reference" / "ckpt"
    started = time.time()
    say(f"chaos schedule: reference, 2 ranks to iteration {switch}, then 1 rank")
    base = _base(config, ref)
    env = {"OMP_NUM_THREADS": "1"}
    two = LaunchSpec(
        [*base, "--exit-interval", str(switch)],
        2,
        launcher=_launcher(config, 2, DEVICES, 0),
        env=env,
    )
    one = LaunchSpec(base, 1, launcher=_launcher(config, 1, ("dev-a",), 0), env=env)
    for name, spec in (("2-ranks", two), ("1-rank", one)):
        code = finish(Job(spec, config.work_dir / "reference" / f"{name}.log"), config.timeout).code
        res.check(code == 0, f"reference {name} exited {code}")
    res.reference_seconds = time.time() - started
    name = layout.iteration_dir_name(config.iterations)
    if not (save / name).is_dir() or not (ref / name).is_dir():
        res.bitwise_equal = False
        res.check(False, f"no final checkpoint {name} in {save} or {ref}")
        return
    equal, why = params_equal(save / name, ref / name)
    res.bitwise_equal = equal
    res.check(equal, f"final parameters differ from the fault-free run: {why}")


def format_result(res: ScheduleResult) -> str:
    g = res.goodput
    lines = [
        f"fault schedule: {'passed' if res.passed else 'FAILED'}; wall {res.wall_seconds:.0f} s; "
        f"goodput {100 * g.get('goodput', 0.0):.1f}%; bitwise equal: {res.bitwise_equal}"
    ]
    secs = g.get("seconds", {})
    lines.append("buckets (s): " + ", ".join(f"{k} {v:.1f}" for k, v in secs.items() if v))
    lines += [
        f"  {f['kind']:<18} iteration {f['iteration']:<6} -> {f.get('action', '?')}: "
        f"recomputed {f.get('recomputed', '?')} iterations ({f.get('lost_work_s', 0):.1f} s "
        f"of lost work{_rerun_note(f)}); {f.get('detail', '')}"
        for f in res.faults
    ]
    lines += [f"  problem: {p}" for p in res.problems]
    return "\n".join(lines)


def _rerun_note(row: dict[str, Any]) -> str:
    return f", {row['rerun_s']:.2f} s of rerun" if "rerun_s" in row else ""


def write_json(res: ScheduleResult, path: str | os.PathLike[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(res.to_json(), indent=2) + "\n", encoding="utf-8")
