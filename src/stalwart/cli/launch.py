"""``stalwart launch [launch and torchrun options] -- TRAIN_ARGS``: torchrun whose relaunches act
on the job's verdicts (``stalwart.distributed.launch``; the policy in
``stalwart.distributed.launch_policy``).

Bad input (a launch flag, a torchrun flag, missing ``--save``) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from stalwart.cli.arg_types import switch
from stalwart.cli.args import OneLineErrorParser
from stalwart.iteration_dirs import tracker_iteration

if TYPE_CHECKING:
    from stalwart.distributed.launch import LaunchPlan
    from stalwart.distributed.launch_policy import LaunchAction

PROG = "stalwart launch"
MAX_RESTARTS_LIMIT = 10_000

DESCRIPTION = """\
Run `stalwart train TRAIN_ARGS` under torchrun's elastic agent and act on how each launch ends:
  every rank 0                          stop, exit 0
  a rank exited 2 (bad input)           stop, exit 2
  the launcher got SIGTERM (preempted)  stop (the workers saved), exit 128 + signal
  exit 16/17, suspect_devices.json      relaunch without the suspect devices: a spare takes the
    names devices in use                place, else one rank fewer (the global batch kept by more
                                        micro-batches per rank; the DCP checkpoint is resharded)
  exit 16 (resume on other hardware)    relaunch on spare devices, else say what to do
  exit 17 without suspects, a hang, a   restart on the same devices
    dead rank, any other failure
Every relaunch spends one of --max-restarts; with none left: the first failed rank's code.
Several nodes (--nnodes > 1), or a suspect on another node: the node is left out (SLURM:
scontrol update ExcNodeList + scontrol requeue, printed, run with --slurm-requeue).
Each action goes to <run dir>/goodput.jsonl and events.jsonl (stalwart goodput lists them).
Other options before -- are torchrun's (--rdzv-endpoint, --rdzv-id, --log-dir, ...)."""

EPILOG = """\
examples:
  stalwart launch --nproc-per-node 8 --max-restarts 3 -- --preset gpt2-124m --save ckpt \\
      --global-batch-size 512 --micro-batch-size 8
  stalwart launch --devices 0,1,2,3,4,5,6,7,8 --nproc-per-node 8 -- ...   (GPU 8 is a spare)
  stalwart launch --nproc-per-node 3 --devices cpu-a,cpu-b,cpu-c -- --use-cpu ...   (fake ids)"""


class _TorchrunArgError(ValueError):
    pass


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog=PROG, usage=f"{PROG} [options] -- TRAIN_ARGS", description=DESCRIPTION, epilog=EPILOG
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        metavar="N",
        help="ranks on this node (default: one per --devices entry)",
    )
    p.add_argument(
        "--nnodes", default="1", metavar="N", help="nodes, as torchrun takes it (N or MIN:MAX)"
    )
    p.add_argument(
        "--max-restarts",
        "--max_restarts",
        type=int,
        default=3,
        metavar="N",
        help="restart budget: relaunches of any kind before giving up",
    )
    p.add_argument(
        "--devices",
        metavar="LIST",
        help="this node's devices, comma list: the first --nproc-per-node in use, the rest spares "
        "(default: $CUDA_VISIBLE_DEVICES or every GPU; on CPU cpu:0,...: fake ids, exported as "
        "$STALWART_VISIBLE_DEVICES)",
    )
    p.add_argument(
        "--module",
        default="stalwart",
        metavar="MOD",
        help="worker module: stalwart runs `stalwart train`, another module gets "
        "TRAIN_ARGS as they are (it must take --save and use stalwart's exit codes)",
    )
    switch(
        p,
        "--slurm-requeue",
        "run the scontrol commands that move the job off a node (default: print)",
    )
    switch(
        p,
        "--fork-workers",
        "fork each round's workers from this launcher, which imports torch, the trainer and "
        "(with --compile) Dynamo and Inductor once: a relaunch skips the interpreter start "
        "and those imports (--module stalwart only)",
    )
    return p


def _error(message: str) -> NoReturn:
    sys.stderr.write(f"{PROG}: error: {message}\n")
    raise SystemExit(2)


def _flag_value(args: list[str], flag: str) -> str | None:
    """The last value of ``flag`` (``--flag V`` or ``--flag=V``) in ``args``."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg[len(flag) + 1 :]
    return value


def _int_value(args: list[str], flag: str) -> int | None:
    value = _flag_value(args, flag)
    return int(value) if value is not None and value.isdigit() else None


def _nnodes(text: str) -> int:
    parts = text.split(":")
    if len(parts) > 2 or not all(p.isdigit() and int(p) >= 1 for p in parts):
        _error(f"--nnodes must be N or MIN:MAX with integers >= 1, got {text!r}")
    return int(parts[-1])


def _devices(ns: argparse.Namespace, cuda: bool) -> list[str]:
    from stalwart.distributed.launch_env import env_device_list

    try:
        if ns.devices is not None:
            devices = env_device_list("--devices", environ={"--devices": ns.devices})
            if not devices:
                _error("--devices is empty (it takes a comma list of device ids)")
        elif cuda:
            devices = env_device_list("CUDA_VISIBLE_DEVICES") or _cuda_indices()
        else:
            devices = [f"cpu:{i}" for i in range(ns.nproc_per_node or 1)]
    except ValueError as exc:
        _error(str(exc).replace("environment variable --devices=", "--devices "))
    if len(set(devices)) != len(devices):
        _error(f"--devices names a device twice: {','.join(devices)}")
    nproc = ns.nproc_per_node or len(devices)
    if not 1 <= nproc <= len(devices):
        _error(
            f"--nproc-per-node must be between 1 and the {len(devices)} device(s) of --devices, "
            f"got {nproc}"
        )
    return devices


def _cuda_indices() -> list[str]:
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]


def _check_torchrun_args(argv: list[str]) -> None:
    """torchrun's own parser on the options it gets, its error as one line."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.allow_abbrev = False  # "--max-restart" must not reach torchrun as its --max-restarts

    def error(message: str) -> NoReturn:
        raise _TorchrunArgError(message)

    parser.error = error  # type: ignore[method-assign]
    try:
        parser.parse_args(argv)
    except _TorchrunArgError as exc:
        _error(f"torchrun option: {exc}")


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(launch and torchrun options, TRAIN_ARGS) at the first ``--``."""
    if "--" not in argv:
        if any(a in ("-h", "--help") for a in argv):
            return argv, []
        _error("put the train args after -- (stalwart launch [options] -- --save DIR ...)")
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def main_launch(argv: list[str]) -> int:
    """``stalwart launch``: check the options, then launch until an action stops."""
    from stalwart.distributed.launch import run_launches

    try:
        plan = build_plan(argv)
    except SystemExit as exc:  # one line already written (or --help)
        return exc.code if isinstance(exc.code, int) else 2
    return run_launches(plan, record_launch_action)


def record_launch_action(plan: LaunchPlan, action: LaunchAction) -> None:
    """The action's line on stderr, in the goodput ledger and in ``events.jsonl``."""
    from stalwart.observability.goodput import record_action
    from stalwart.observability.run_dir import EventKind, append_event

    sys.stderr.write(f"stalwart launch: {action.kind.value}: {action.line}\n")
    sys.stderr.flush()
    code = action.exit_code if not action.kind.relaunches else None
    try:
        record_action(
            plan.run_dir,
            action.kind.value,
            action.line,
            exit_code=code,
            world_size=len(action.devices),
            devices=action.devices,
        )
        append_event(
            plan.run_dir,
            _tracker_iteration(plan.save),
            EventKind.LAUNCH,
            f"{action.kind.value}: {action.line}",
        )
    except OSError as exc:  # the job's next step must not depend on a full disk
        sys.stderr.write(f"stalwart launch: cannot record the action in {plan.run_dir}: {exc}\n")


def _tracker_iteration(save: str) -> int:
    with contextlib.suppress(ValueError):
        return tracker_iteration(save) or 0
    return 0


@dataclass(frozen=True)
class TrainSettings:
    """What the launcher reads of the train args: where the verdicts and the ledger are, the
    batch it must keep on fewer ranks, and what decides the device kind and the imports."""

    save: str | None
    run_dir: str | None
    global_batch_size: int | None
    micro_batch_size: int | None
    use_cpu: bool
    compile: bool


def train_settings(module: str, train_args: list[str]) -> TrainSettings:
    """The train args as the worker reads them. ``--module stalwart``: parsed and built by
    ``stalwart train``'s own parser and config (``--config FILE`` included, the command line
    winning, the preset's micro batch), so a bad train arg is one line here, before any launch;
    another module: its ``--save``, ``--run-dir``, ``--global-batch-size``,
    ``--micro-batch-size``, ``--use-cpu`` and ``--compile`` as given on the command line."""
    if module != "stalwart":
        return TrainSettings(
            save=_flag_value(train_args, "--save"),
            run_dir=_flag_value(train_args, "--run-dir"),
            global_batch_size=_int_value(train_args, "--global-batch-size"),
            micro_batch_size=_int_value(train_args, "--micro-batch-size"),
            use_cpu="--use-cpu" in train_args,
            compile="--compile" in train_args,
        )
    from stalwart.cli.args import parse_train_args
    from stalwart.config.run import build_run_config

    try:
        config = build_run_config(parse_train_args(train_args, raise_errors=True), train_args)
    except ValueError as exc:
        _error(f"train args: {exc}")
    return TrainSettings(
        save=config.checkpoint.save,
        run_dir=config.shell.run_dir,
        global_batch_size=config.training.global_batch_size,
        micro_batch_size=config.training.micro_batch_size,
        use_cpu=config.training.use_cpu,
        compile=config.training.compile,
    )


def build_plan(argv: list[str]) -> LaunchPlan:
    """The launch plan of ``argv``; SystemExit(2) after one line on stderr when it is bad."""
    from stalwart.distributed.launch import LaunchPlan

    own, train_args = split_argv(argv)
    ns, torchrun_args = build_parser().parse_known_args(own)
    if not 0 <= ns.max_restarts <= MAX_RESTARTS_LIMIT:
        _error(
            f"--max-restarts (the restart budget) must be in [0, {MAX_RESTARTS_LIMIT}], got "
            f"{ns.max_restarts}"
        )
    nnodes = _nnodes(ns.nnodes)
    if ns.fork_workers and ns.module != "stalwart":
        _error(
            "--fork-workers runs `stalwart train` in the forked workers: it needs --module stalwart"
        )
    train = train_settings(ns.module, train_args)
    if not train.save:
        _error(
            "the train args need --save DIR (or save in their --config file): the verdicts "
            "(suspect_devices.json) and the checkpoint to resume are there"
        )
    slurm_job, host = _slurm_node(ns.slurm_requeue)
    if ns.fork_workers:
        # NVML answers "is there a GPU" without initialising CUDA in this process: a worker
        # forked from a process that initialised CUDA cannot use it.
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    cuda = _cuda_available() and not train.use_cpu
    devices = _devices(ns, cuda)
    nproc = ns.nproc_per_node or len(devices)
    command = ["-m", ns.module, *(["train"] if ns.module == "stalwart" else []), *train_args]
    torchrun = [*torchrun_args, "--nnodes", ns.nnodes]
    _check_torchrun_args([*torchrun, "--nproc-per-node", str(nproc), *command])
    return LaunchPlan(
        torchrun_args=torchrun,
        command=command,
        devices=tuple(devices[:nproc]),
        spares=tuple(devices[nproc:]),
        save=train.save,
        run_dir=train.run_dir or train.save,
        max_restarts=ns.max_restarts,
        device_env="CUDA_VISIBLE_DEVICES" if cuda else "STALWART_VISIBLE_DEVICES",
        nnodes=nnodes,
        global_batch_size=train.global_batch_size,
        micro_batch_size=train.micro_batch_size,
        slurm_job=slurm_job,
        run_slurm=ns.slurm_requeue,
        host=host,
        worker=forking_worker(train.compile) if ns.fork_workers else None,
    )


def _slurm_node(run_slurm: bool) -> tuple[str | None, str]:
    """(SLURM's job id or None, this node's name as SLURM knows it: ``$SLURMD_NODENAME``; the
    hostname outside SLURM); a bad value, or ``--slurm-requeue`` where scontrol could not name
    this node, is one line."""
    from stalwart.distributed.launch_env import env_token, node_name

    try:
        slurm_job = env_token("SLURM_JOB_ID", "") or env_token("SLURM_JOBID", "") or None
        host = node_name()
        slurm_node = env_token("SLURMD_NODENAME", "")
    except ValueError as exc:
        _error(str(exc))
    if run_slurm and slurm_job is None:
        _error("--slurm-requeue runs scontrol for the SLURM job: $SLURM_JOB_ID is not set")
    if run_slurm and not slurm_node:
        _error(
            "--slurm-requeue needs $SLURMD_NODENAME (SLURM's name of this node, for "
            "ExcNodeList): run stalwart launch inside the job on its node (sbatch script or srun)"
        )
    return slurm_job, host


def _cuda_available() -> bool:
    import torch

    return bool(torch.cuda.is_available())


# What a restarted worker imports after its start, beyond the trainer's own imports: its lazy
# imports (the checkpoint load, the run's start), and with --compile what a compile imports on
# its first call (Dynamo's trace, AOTAutograd's cache, Inductor's backends and passes). Imported
# once by the launcher, they are not imported again by every restart: where the installed torch
# has no bytecode cache, each costs its source compilation too. A name this torch lacks is passed
# over. Measured: the modules new in a worker after its first compiled iteration, the costliest.
# Dynamo without --compile too: DDP's constructor imports it (~200 modules: ~1 CPU-s a worker on
# an idle machine, 4 s on a loaded one), and so does torch's log formatter in this launcher at
# the first failed round it logs, between the failure and the relaunch.
RESTART_IMPORTS = (
    "torch._dynamo",
    "stalwart.cli.main",
    "stalwart.cli.run_start",
    "stalwart.config.memory_check",
    "torch.distributed.checkpoint",
    "torch.distributed.checkpoint.state_dict",
    "torch.distributed.tensor.experimental",
    "psutil",
)
COMPILE_IMPORTS = (
    "torch._dynamo",
    "torch._inductor.codecache",
    "torch._inductor.compile_fx",
    "torch._inductor.config",
    "torch._inductor.runtime.triton_heuristics",  # GPU builds: loads the cached kernels
    "torch._inductor.codegen.triton",
    "torch._inductor.codegen.cuda_combined_scheduling",
    "torch._inductor.codegen.wrapper_fxir",
    "torch._inductor.codegen.memory_planning",
    "torch._inductor.choices",
    "torch._inductor.bounds",
    "torch._inductor.fx_passes.pad_mm",
    "torch._inductor.fx_passes.quantization",
    "torch._functorch._aot_autograd.subclass_codegen",
    "torch.fx.experimental.validator",
    "torch.export._trace",
    "torch.utils.cpp_extension",
    "sympy.physics.units",
    "triton.compiler.compiler",
)


def forking_worker(compiles: bool) -> Callable[..., None]:
    """``--fork-workers``: import now what every worker would import after its start (the
    trainer, `RESTART_IMPORTS`; `COMPILE_IMPORTS` when it compiles), once in this launcher, and
    return the function the forked workers run. Nothing here initialises CUDA (checked before
    each fork)."""
    import stalwart.cli.train
    import stalwart.train.trainer  # noqa: F401

    for name in RESTART_IMPORTS + (COMPILE_IMPORTS if compiles else ()):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)
    return forked_worker


# The signals torchrun's agent handles in this process (it raises in its own loop); a forked
# worker starts with the defaults an exec'd one has.
_AGENT_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def forked_worker(*argv: str) -> None:
    """``stalwart <argv>`` in a worker that torchrun's agent forked from the launcher
    (``--fork-workers``): the process state an exec'd worker would start with (default signal
    handlers, no exit handlers of the launcher's), then the CLI; its exit code leaves as the
    process's (``SystemExit``, as ``python -m stalwart`` exits), 0 by returning."""
    for signum in _AGENT_SIGNALS:
        signal.signal(signum, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    # The launcher's exit handlers are not this worker's to run; the worker's own (the save
    # lock's release) must run, and a forked process ends in os._exit, which skips them.
    atexit._clear()
    sys.argv = [sys.argv[0], *argv]
    # It runs the launcher's command line: the name (`ps -o comm`, /proc/PID/comm) tells the
    # ranks apart, as an exec'd worker's environment does.
    with contextlib.suppress(OSError):
        Path("/proc/self/comm").write_text(f"stalwart-r{os.environ.get('RANK', '')}")
    from stalwart.cli.main import main

    try:
        code = main(list(argv))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        atexit._run_exitfuncs()
    if code:
        raise SystemExit(code)
    _exit_after_return()


def _exit_after_return() -> None:
    """Let this worker exit right after torch hands its return value to the agent.

    torchrun's ``_wrap`` (this function's caller in a forked worker) writes the return value to
    a pipe, then waits on an event until the agent has read every rank's value; an agent that is
    shutting down (the launcher got SIGTERM: the workers save and return) never reads it, and
    the worker would wait 30 s for its SIGKILL. The value is in the pipe before the wait, so the
    event is set here, before the return; without that frame (another torch), nothing changes.
    """
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "_wrap":
            event = frame.f_locals.get("queue_finished_reading_event")
            if event is not None:
                event.set()
            return
        frame = frame.f_back  # type: ignore[assignment]
