"""What ``stalwart launch`` does after a torchrun launch ended: a pure function from the outcome
to the next action.

Inputs (:class:`LaunchOutcome`): every rank's exit code (or a signal the launcher itself got),
the suspect devices a verdict named (``suspect_devices.json``), the devices in use and the spare
ones, the restarts left, the node and the SLURM job. The documented outcomes and their next
steps (docs/reliability.md, "stalwart launch"):

============================================  =================================================
outcome                                       action
============================================  =================================================
every rank 0                                  ``finished``: stop, exit 0
a rank exited 2 (bad input)                   ``bad_input``: stop, exit 2 (a relaunch fails again)
the launcher got SIGTERM/SIGINT (preempted)   ``preempted``: stop (the workers saved); 128 + signal
16/17 and a verdict names devices in use:
  one node, spares                            ``replace``: the suspects' places go to spares
  one node, no spare                          ``exclude``: one rank fewer per suspect, the global
                                              batch kept by more micro-batches per rank (DCP
                                              reshards the checkpoint on load)
  the batch cannot be kept, no device left    ``operator``: stop with what to do
  several nodes, or a suspect on another      ``requeue`` under SLURM (exclude the node, requeue);
  node                                        else ``operator`` naming the node to leave out
16 (resume on other hardware), no suspect     ``move`` to spares when there are enough; SLURM:
                                              ``requeue`` off this node; else ``operator``
17 without suspects (transient), a hang, a    ``restart`` on the same devices
dead rank, any other failure
============================================  =================================================

Every relaunch (``restart``, ``replace``, ``exclude``, ``move``) spends one restart of the
budget (``--max-restarts``); with none left the action is ``exhausted``: stop with the code of the
rank that failed first, named in the line.

Example::

    action = decide(LaunchOutcome(exit_codes={0: 17, 1: 17}, devices=("a", "b", "c"),
                                  suspects=(("node", "b"),), host="node", restarts_left=2,
                                  global_batch_size=12, micro_batch_size=2))
    assert action.kind is ActionKind.EXCLUDE and action.devices == ("a", "c")
"""

from __future__ import annotations

import enum
import signal
from dataclasses import dataclass, field

EXIT_BAD_INPUT = 2
EXIT_RESUME_ELSEWHERE = 16  # stalwart.reliability.rerun.types (not imported: no torch here)
EXIT_FAILED_VALIDATION = 17

Identity = tuple[str, str]  # (node, device), as the verdict files name them


class ActionKind(enum.Enum):
    """What the launcher does next."""

    FINISHED = "finished"
    BAD_INPUT = "bad_input"
    PREEMPTED = "preempted"
    RESTART = "restart"
    REPLACE = "replace"
    EXCLUDE = "exclude"
    MOVE = "move"
    REQUEUE = "requeue"
    OPERATOR = "operator"
    EXHAUSTED = "exhausted"

    @property
    def relaunches(self) -> bool:
        return self in _RELAUNCHING


_RELAUNCHING = frozenset(
    {ActionKind.RESTART, ActionKind.REPLACE, ActionKind.EXCLUDE, ActionKind.MOVE}
)


@dataclass(frozen=True)
class LaunchOutcome:
    """How one launch ended, and what the launcher has (see module docstring).

    ``exit_codes``: global rank -> exit code (negative: killed by that signal) of every rank
    torchrun reported (all of them on success; the failed ones otherwise); ``first_failed``:
    the rank torchrun saw fail first; ``launcher_signal``: the signal that stopped the launcher
    itself; ``suspects``: the (node, device) pairs of ``suspect_devices.json``; ``devices``: the
    devices in use on this node, in local-rank order; ``spares``: devices of this node not in
    use and not excluded; ``slurm_job``: ``$SLURM_JOB_ID`` or None.
    """

    exit_codes: dict[int, int]
    devices: tuple[str, ...]
    host: str
    restarts_left: int
    first_failed: int | None = None
    launcher_signal: int | None = None
    suspects: tuple[Identity, ...] = ()
    spares: tuple[str, ...] = ()
    nnodes: int = 1
    slurm_job: str | None = None
    global_batch_size: int | None = None
    micro_batch_size: int | None = None


@dataclass(frozen=True)
class LaunchAction:
    """The next step: ``kind``; ``devices``/``spares`` of the next launch (unchanged when it
    does not relaunch); ``exit_code`` when it stops; ``line``: one line saying what happened and
    what is done; ``commands``: shell commands (SLURM) that move the job, printed, run on request;
    ``excluded``: the devices (or, for ``requeue``, nodes) this action leaves out."""

    kind: ActionKind
    line: str
    devices: tuple[str, ...]
    spares: tuple[str, ...] = ()
    exit_code: int = 0
    commands: tuple[tuple[str, ...], ...] = ()
    excluded: tuple[str, ...] = field(default_factory=tuple)


def process_exit_code(code: int) -> int:
    """A worker's code as a process exit status: a signal ``-s`` becomes ``128 + s``."""
    return 128 - code if code < 0 else min(code, 255)


def describe_code(code: int) -> str:
    if code < 0:
        try:
            return f"{code} ({signal.Signals(-code).name})"
        except ValueError:
            return str(code)
    return str(code)


def decide(outcome: LaunchOutcome) -> LaunchAction:
    """The action for ``outcome`` (pure: no I/O, no clock)."""
    o = outcome
    if o.launcher_signal is not None:
        name = _signal_name(o.launcher_signal)
        line = f"the launcher got {name}: the workers saved and stopped; not relaunched here " + (
            "(SLURM requeues a job submitted with --requeue)"
            if o.slurm_job
            else "(run the same command again to resume)"
        )
        return _stay(o, ActionKind.PREEMPTED, line, 128 + o.launcher_signal)
    failed = {r: c for r, c in o.exit_codes.items() if c != 0}
    if not failed:
        return _stay(o, ActionKind.FINISHED, "every rank exited 0: done", 0)
    bad = sorted(r for r, c in failed.items() if c == EXIT_BAD_INPUT)
    if bad:
        line = f"rank {bad[0]} exited 2 (bad input, named above): not relaunched"
        return _stay(o, ActionKind.BAD_INPUT, line, EXIT_BAD_INPUT)
    codes = set(failed.values())
    verdict = codes & {EXIT_RESUME_ELSEWHERE, EXIT_FAILED_VALIDATION}
    # A single-node job left other nodes behind; an excluded device's old verdict is settled.
    in_use = [
        s
        for s in o.suspects
        if (s[0] == o.host and s[1] in o.devices) or (o.nnodes > 1 and s[0] != o.host)
    ]
    if verdict and in_use:
        action = _exclude(o, in_use, max(verdict))
    elif EXIT_RESUME_ELSEWHERE in codes:
        action = _move(o)
    else:
        rank, code = _root(o, failed)
        why = (
            # 17 is Megatron's persistent result-validation failure; its device is not in use here
            # (already excluded, or none was named), so the same devices run it again.
            "a result-validation failure on no device in use"
            if code == EXIT_FAILED_VALIDATION
            else "killed: a hang its watchdog ended, or a dead rank"
            if code < 0
            else "a failure"
        )
        line = f"rank {rank} exited {describe_code(code)} ({why}): restarting on the same devices"
        action = _stay(o, ActionKind.RESTART, line, 0)
    return _within_budget(o, failed, action)


def _stay(o: LaunchOutcome, kind: ActionKind, line: str, code: int) -> LaunchAction:
    """An action that keeps the devices (a stop, or a restart on the same ones)."""
    return LaunchAction(kind, line, o.devices, o.spares, exit_code=code)


def _within_budget(o: LaunchOutcome, failed: dict[int, int], action: LaunchAction) -> LaunchAction:
    if not action.kind.relaunches or o.restarts_left > 0:
        return action
    rank, code = _root(o, failed)
    line = (
        f"restart budget exhausted (--max-restarts): rank {rank} exited {describe_code(code)}; "
        f"giving up instead of: {action.line}"
    )
    return LaunchAction(
        ActionKind.EXHAUSTED, line, o.devices, o.spares, exit_code=process_exit_code(code)
    )


def _root(o: LaunchOutcome, failed: dict[int, int]) -> tuple[int, int]:
    rank = o.first_failed if o.first_failed in failed else min(failed)
    assert rank is not None
    return rank, failed[rank]


def _exclude(o: LaunchOutcome, suspects: list[Identity], code: int) -> LaunchAction:
    where = ", ".join(f"{n}/{d}" for n, d in suspects)
    nodes = sorted({n for n, _ in suspects})
    if o.nnodes > 1 or nodes != [o.host]:
        return _leave_nodes(o, nodes, f"exit {code}: suspect device(s) {where}", code)
    bad = {d for _, d in suspects}
    kept = tuple(d for d in o.devices if d not in bad)
    spares = tuple(d for d in o.spares if d not in bad)
    gone = tuple(d for d in o.devices if d in bad)
    if len(spares) >= len(gone):  # same world size: the fault-free run's batch layout
        swap = dict(zip(gone, spares, strict=False))
        devices = tuple(swap.get(d, d) for d in o.devices)
        line = f"exit {code}: suspect device(s) {where}: relaunching with " + ", ".join(
            f"{d} -> {swap[d]}" for d in gone
        )
        return LaunchAction(ActionKind.REPLACE, line, devices, spares[len(gone) :], excluded=gone)
    problem = _batch_problem(o, len(kept))
    if problem:
        line = f"exit {code}: suspect device(s) {where}, no spare device: {problem}"
        return LaunchAction(ActionKind.OPERATOR, line, o.devices, o.spares, exit_code=code)
    per_rank = _micro_batches(o, len(kept))
    line = (
        f"exit {code}: suspect device(s) {where}: relaunching without them on {len(kept)} "
        f"rank(s) ({', '.join(kept)}), global batch {o.global_batch_size} kept: {per_rank} "
        "micro-batches per rank, the checkpoint resharded on load"
    )
    return LaunchAction(ActionKind.EXCLUDE, line, kept, spares, excluded=gone)


def _batch_problem(o: LaunchOutcome, world: int) -> str:
    """Why the job cannot go on with ``world`` local ranks (empty when it can)."""
    if world < 1:
        return "no device left on this node; relaunch the job on other hardware"
    if o.global_batch_size is None or o.micro_batch_size is None:
        return (
            f"relaunching on {world} rank(s) would change the global batch: pass "
            "--global-batch-size and --micro-batch-size in the train args (or relaunch elsewhere)"
        )
    if o.global_batch_size % (o.micro_batch_size * world * o.nnodes):
        return (
            f"--global-batch-size {o.global_batch_size} is not a multiple of --micro-batch-size "
            f"{o.micro_batch_size} x {world} rank(s); relaunch on {len(o.devices)} device(s) "
            "elsewhere, or pick a global batch both world sizes divide"
        )
    return ""


def _micro_batches(o: LaunchOutcome, world: int) -> int:
    assert o.global_batch_size is not None and o.micro_batch_size is not None
    return o.global_batch_size // (o.micro_batch_size * world * o.nnodes)


def _move(o: LaunchOutcome) -> LaunchAction:
    world = len(o.devices)
    if len(o.spares) >= world:
        devices = o.spares[:world]
        line = (
            f"exit 16 (resume on other hardware): relaunching on the spare device(s) "
            f"{', '.join(devices)} instead of {', '.join(o.devices)}"
        )
        return LaunchAction(
            ActionKind.MOVE, line, devices, o.spares[world:] + o.devices, excluded=o.devices
        )
    if o.slurm_job is not None and o.nnodes == 1:
        return _leave_nodes(
            o, [o.host], "exit 16 (resume on other hardware)", EXIT_RESUME_ELSEWHERE
        )
    line = (
        f"exit 16 (resume on other hardware): only {len(o.spares)} spare device(s) for "
        f"{world} rank(s) on {o.host}: relaunch this job on other devices or another node "
        "(more --devices, or a scheduler that excludes this node)"
    )
    return LaunchAction(
        ActionKind.OPERATOR, line, o.devices, o.spares, exit_code=EXIT_RESUME_ELSEWHERE
    )


def _leave_nodes(o: LaunchOutcome, nodes: list[str], what: str, code: int) -> LaunchAction:
    """Move the job off ``nodes``: SLURM's requeue with the nodes excluded, or the line to do
    it by hand."""
    listed = ",".join(nodes)
    if o.slurm_job is None:
        line = (
            f"{what}: relaunch the job without node(s) {listed} (SLURM: sbatch "
            f"--exclude={listed} ...; torchrun: leave the node out of the rendezvous)"
        )
        return LaunchAction(ActionKind.OPERATOR, line, o.devices, o.spares, exit_code=code)
    commands = (
        ("scontrol", "update", f"JobId={o.slurm_job}", f"ExcNodeList={listed}"),
        ("scontrol", "requeue", o.slurm_job),
    )
    line = (
        f"{what}: move SLURM job {o.slurm_job} off node(s) {listed}: "
        + "; ".join(" ".join(c) for c in commands)
        + f" (or resubmit with sbatch --exclude={listed})"
    )
    return LaunchAction(
        ActionKind.REQUEUE,
        line,
        o.devices,
        o.spares,
        exit_code=code,
        commands=commands,
        excluded=tuple(nodes),
    )


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
