"""``stalwart launch``: torchrun's own elastic agent, relaunched by the verdicts of the job.

Each round runs one torchrun launch (``torch.distributed.run.run``: the same agent, rendezvous,
signal forwarding and worker logs as ``torchrun``, with torchrun's own ``--max-restarts 0``),
reads how it ended (every failed rank's exit code from torchrun's ``ChildFailedError``, a signal
the launcher got, ``suspect_devices.json`` in ``--save``), asks the pure policy
(:func:`stalwart.distributed.launch_policy.decide`) what to do, records the action, then does
it: relaunch with the devices the action names, or stop with its exit code.

Devices: local rank ``r`` of a launch runs on entry ``r`` of the devices in use, exported as
``CUDA_VISIBLE_DEVICES`` on GPUs and ``STALWART_VISIBLE_DEVICES`` (fake ids) on CPU, which
``stalwart.reliability.rerun.device_identity`` reads: the verdict names the same device that the
relaunch leaves out.

Each action goes to the caller's ``record``: ``stalwart launch`` writes it to ``<run
dir>/goodput.jsonl`` (an ``action`` record) and ``<run dir>/events.jsonl`` (kind ``launch``), and
one line to stderr.

Example (what ``stalwart launch --nproc-per-node 3 --devices a,b,c,d -- --save ckpt ...`` does)::

    plan = LaunchPlan(torchrun_args=["--standalone"], command=["-m", "stalwart", "train", ...],
                      devices=("a", "b", "c"), spares=("d",), save="ckpt", run_dir="ckpt",
                      max_restarts=3, device_env="STALWART_VISIBLE_DEVICES")
    exit_code = run_launches(plan, record_launch_action)  # stalwart.cli.launch's
"""

from __future__ import annotations

import functools
import itertools
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from stalwart.distributed.launch_env import node_name
from stalwart.distributed.launch_policy import (
    ActionKind,
    Identity,
    LaunchAction,
    LaunchOutcome,
    decide,
)

logger = logging.getLogger(__name__)

SUSPECTS_FILENAME = "suspect_devices.json"  # stalwart.reliability.rerun.attribution.verdict_file's


@dataclass(frozen=True)
class LaunchPlan:
    """What every round launches (see module docstring).

    ``torchrun_args``: torchrun options other than ``--nproc-per-node``/``--max-restarts``
    (``--nnodes``, ``--rdzv-*``, ``--standalone``, ...); ``command``: the worker entry as torchrun
    takes it (``-m stalwart train ARGS``); ``devices``/``spares``: this node's devices in use and
    spare; ``device_env``: the variable that hands them to the workers; ``slurm_job``: SLURM's job
    id (None outside SLURM); ``host``: this node as the verdicts and SLURM name it
    (`stalwart.distributed.launch_env.node_name`); ``run_slurm``: run the requeue commands
    instead of printing them (a missing or failing ``scontrol`` is one line, the action's exit
    code kept);
    ``worker``: with it, each worker is forked from this launcher and runs ``worker(*args)``
    (``args``: the command after ``-m MODULE``) instead of torchrun exec'ing a fresh interpreter
    (see :func:`torchrun_round`).
    """

    torchrun_args: Sequence[str]
    command: Sequence[str]
    devices: tuple[str, ...]
    spares: tuple[str, ...]
    save: str
    run_dir: str
    max_restarts: int
    device_env: str
    nnodes: int = 1
    global_batch_size: int | None = None
    micro_batch_size: int | None = None
    slurm_job: str | None = None
    run_slurm: bool = False
    host: str = field(default_factory=node_name)
    worker: Callable[..., None] | None = None


@dataclass(frozen=True)
class RoundResult:
    """One torchrun launch's end: failed ranks' codes (all ranks 0 on success), the rank that
    failed first, the signal that stopped the launcher."""

    exit_codes: dict[int, int]
    first_failed: int | None = None
    launcher_signal: int | None = None


def torchrun_round(argv: list[str], worker: Callable[..., None] | None = None) -> RoundResult:
    """One launch through torchrun's own ``run`` (its argument parser, rendezvous set-up, agent).

    With ``worker``, the agent forks its workers from this process (torchrun's own
    function-entrypoint path, start method ``fork``) and each runs ``worker(*script_args)``: a
    relaunch skips the interpreter start and every import this process has done (torch, and
    what the caller imported before, e.g. Dynamo and Inductor: ~7 s of a 124M-parameter GPU
    relaunch). This process must not have initialised CUDA (a forked child cannot use it then);
    the caller checks that before every round."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    args = torchrun.parse_args(argv)
    exec_launch = torchrun.elastic_launch
    if worker is not None:
        # torchrun's run() normalises the rendezvous options, then calls its elastic_launch
        # with the exec entrypoint; this round's launch swaps in the forked function instead
        # (restored below: the module is torch's, this process runs one round at a time).
        forked = functools.partial(_forked_launch, exec_launch, worker)
        torchrun.elastic_launch = forked  # type: ignore[assignment,misc]
    try:
        torchrun.run(args)
    except ChildFailedError as exc:
        codes = {int(rank): int(f.exitcode) for rank, f in exc.failures.items()}
        first, _ = exc.get_first_failure()
        return RoundResult(codes, first_failed=int(first))
    except SignalException as exc:  # the launcher itself was signalled: workers got it forwarded
        return RoundResult({}, launcher_signal=int(exc.sigval))
    finally:
        torchrun.elastic_launch = exec_launch  # type: ignore[assignment,misc]
    return RoundResult({0: 0})  # torchrun returns only when every rank exited 0


def _forked_launch(
    launch: Callable[..., Any], worker: Callable[..., None], config: Any, entrypoint: object
) -> Callable[..., Any]:
    """torchrun's ``elastic_launch(config, entrypoint)`` with forked workers running ``worker``:
    its ``(*cmd_args)`` are ``-u -m MODULE ARGS``, the worker gets ``ARGS``."""
    import torch

    if torch.cuda.is_initialized():  # a forked worker could not use CUDA: exec them this round
        sys.stderr.write(
            "stalwart launch: --fork-workers: CUDA is initialised in the launcher, a "
            "forked worker cannot use it: this round starts fresh workers\n"
        )
        return launch(config=config, entrypoint=entrypoint)
    sys.stderr.write(
        f"stalwart launch: forking the workers from the launcher (pid {os.getpid()})\n"
    )
    forked = launch(config=replace(config, start_method="fork"), entrypoint=worker)

    def call(*cmd_args: str) -> Any:
        module_at = cmd_args.index("-m")
        return forked(*cmd_args[module_at + 2 :])

    return call


def read_suspects(save: str) -> tuple[Identity, ...]:
    """The (node, device) pairs of ``<save>/suspect_devices.json`` (empty when absent or not
    of that shape: plain JSON, nothing in it runs)."""
    try:
        raw = json.loads((Path(save) / SUSPECTS_FILENAME).read_bytes()[: 1 << 20])
        return tuple(
            (str(s["host"]), str(s["device"]))
            for s in raw["suspects"]
            if isinstance(s.get("host"), str) and isinstance(s.get("device"), str)
        )
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return ()


def _set_round_env(plan: LaunchPlan, index: int) -> None:
    # The launcher's own environment is what torchrun's agent hands every worker; this process
    # runs nothing else, so the variables are set once per round, here. The round tells the
    # goodput ledger that a relaunch's workers start a restart, not the job.
    os.environ[plan.device_env] = ",".join(plan.devices)
    os.environ["STALWART_LAUNCH_ROUND"] = str(index)


SCONTROL_TIMEOUT_S = 120.0  # slurmctld answers in seconds; a hung one must not hold the job


def _move_job(plan: LaunchPlan, action: LaunchAction) -> int:
    """Print, or run (``--slurm-requeue``), the commands that move the job off a node; the
    action's exit code either way (a command that cannot run or fails is one line)."""
    for command in action.commands:
        if not plan.run_slurm:
            sys.stderr.write(f"stalwart launch: to move the job, run: {' '.join(command)}\n")
            continue
        failure = _run_slurm_command(command)
        if failure:
            rest = action.commands[action.commands.index(command) :]
            sys.stderr.write(
                f"stalwart launch: {' '.join(command)}: {failure}; the job stays: run "
                f"{'; '.join(' '.join(c) for c in rest)} by hand\n"
            )
            break
    sys.stderr.flush()
    return action.exit_code


def _run_slurm_command(command: Sequence[str]) -> str:
    """Run one scheduler command; empty on success, else why it failed (one line)."""
    try:
        done = subprocess.run(
            list(command),
            check=False,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=SCONTROL_TIMEOUT_S,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return f"{command[0]} is not on PATH"
    except subprocess.TimeoutExpired:
        return f"no answer within {SCONTROL_TIMEOUT_S:.0f} s"
    except OSError as exc:
        return f"cannot run {command[0]}: {exc.strerror or exc}"
    if done.returncode == 0:
        return ""
    said = next((ln.strip() for ln in (done.stderr + done.stdout).splitlines() if ln.strip()), "")
    return f"exited {done.returncode}" + (f" ({said[:300]})" if said else "")


def run_launches(
    plan: LaunchPlan,
    record: Callable[[LaunchPlan, LaunchAction], None],
    launch_round: Callable[[list[str], Callable[..., None] | None], RoundResult] = torchrun_round,
) -> int:
    """Launch, decide, act, until an action stops; returns the process exit code.

    ``record(plan, action)`` runs once per action, before it is carried out (``stalwart
    launch``'s: `stalwart.cli.launch.record_launch_action`, its line, ledger and event records;
    this module imports no observability)."""
    restarts_left = plan.max_restarts
    for index in itertools.count():
        _set_round_env(plan, index)
        argv = [
            *plan.torchrun_args,
            "--nproc-per-node",
            str(len(plan.devices)),
            "--max-restarts",
            "0",
            *plan.command,
        ]
        result = launch_round(argv, plan.worker)
        outcome = LaunchOutcome(
            exit_codes=result.exit_codes,
            devices=plan.devices,
            host=plan.host,
            restarts_left=restarts_left,
            first_failed=result.first_failed,
            launcher_signal=result.launcher_signal,
            suspects=read_suspects(plan.save),
            spares=plan.spares,
            nnodes=plan.nnodes,
            slurm_job=plan.slurm_job,
            global_batch_size=plan.global_batch_size,
            micro_batch_size=plan.micro_batch_size,
        )
        action = decide(outcome)
        record(plan, action)
        if action.kind is ActionKind.REQUEUE:
            return _move_job(plan, action)
        if not action.kind.relaunches:
            return action.exit_code
        restarts_left -= 1
        plan = replace(plan, devices=action.devices, spares=action.spares)
    raise AssertionError("unreachable")  # itertools.count() does not end
