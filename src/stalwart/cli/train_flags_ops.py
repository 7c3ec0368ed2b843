"""``stalwart train`` flags of the run's shell: reliability, observability and CUDA graphs.

Grouped as the components are (the seed's sections): reliability = rerun state machine, hang
detection, graceful exit, in-process restart, fault injection; observability = logging, timers,
stragglers, memory, energy, dumps, profiler. Megatron's spelling where Megatron has the flag
(second spellings are Megatron's names of the same flag).
"""

from __future__ import annotations

import argparse
from typing import Any

from stalwart.cli.arg_types import Float, Int, LogLevel, OneOf, negated, switch, values
from stalwart.cli.train_flags import group, interval
from stalwart.observability.log_lines import LogFormat
from stalwart.reliability.faults import FAULT_PHASES, FaultKind
from stalwart.reliability.inprocess.config import RestartGranularity
from stalwart.reliability.rerun.config import DEFAULT_MAX_REWINDS
from stalwart.reliability.rerun.remedies import TransientPolicy
from stalwart.reliability.rerun.types import RerunDiagnostic, RerunMode

_RERUN_MODES = (*(m.value for m in RerunMode), "report_stats")


def _error_injection_flags(g: Any) -> None:
    """Megatron's testing switches of the rerun machine (fault injection into its checks)."""
    values(
        g,
        ("--error-injection-rate", int, 0, "testing: inject into 1 of N checks (default: 0 = off)"),
        (
            "--error-injection-type",
            OneOf(RerunDiagnostic, "KIND"),
            RerunDiagnostic.TRANSIENT_ERROR,
            "testing: what is injected",
        ),
    )
    g.add_argument(
        "--error-injection-iterations",
        type=int,
        nargs="+",
        help="testing: only at these iterations (default: any)",
    )
    g.add_argument(
        "--error-injection-ranks",
        type=int,
        nargs="+",
        help="testing: only these ranks inject (default: any)",
    )
    g.add_argument(
        "--error-injection-devices",
        nargs="+",
        metavar="DEVICE",
        help="testing: only ranks on these device ids inject, a faulty device (default: any)",
    )
    switch(
        g,
        "--error-injection-once",
        "testing: each injection fires once per job (marker in --save), like a transient fault",
    )


def rerun_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "reliability.rerun", "reliability: rerun state machine (result validation)")
    values(
        g,
        (
            "--rerun-mode",
            OneOf(_RERUN_MODES, "MODE"),
            RerunMode.VALIDATE_RESULTS,
            "rerun rejected iterations: transient, persistent or correct?",
        ),
    )
    negated(
        g, "--no-check-for-nan-in-loss-and-grad", "do not reject NaN/Inf losses and gradient norms"
    )
    switch(g, "--check-for-spiky-loss", "warn on a loss 10x the largest seen")
    switch(g, "--check-for-large-grads", "warn on a grad norm 10x the largest")
    _error_injection_flags(g)
    g.add_argument(
        "--result-rejected-tracker-filename",
        metavar="FILE",
        help="a line per rejected result; restarts skip them (default: none)",
    )
    g.add_argument(
        "--iterations-to-skip",
        type=int,
        nargs="*",
        default=[],
        help="iterations (as logged) to skip without training",
    )
    g.add_argument(
        "--check-weight-hash-across-dp-replicas-interval",
        type=int,
        default=0,
        help="compare replicas' weights every N iterations and before saves, and inside the "
        "step their all-reduced gradients (a mismatch is rerun and attributed) (default: 0 = off)",
    )
    g.add_argument(
        "--check-weight-hash-sample-fraction",
        type=Float(ge=0.0, le=1.0),
        default=0.0,
        help="every iteration, fingerprint this fraction of the parameters and their all-reduced "
        "gradients inside the step, each every ceil(1/F) iterations (default: 0 = off)",
    )
    g.add_argument(
        "--rerun-peer-replay",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="attribute a rejection the in-place rerun reproduces by replaying it on a peer "
        "data-parallel replica in the same launch; --no-rerun-peer-replay: exit 16 and rerun "
        "after a relaunch, as Megatron (default: on)",
    )
    _transient_and_rewind_flags(g)


def _transient_and_rewind_flags(g: Any) -> None:
    """What a transient verdict costs, and the spike rewind (stalwart's; Megatron has neither)."""
    values(
        g,
        (
            "--rerun-transient-policy",
            OneOf(TransientPolicy, "POLICY"),
            TransientPolicy.EXIT,
            "transient verdict: exit 17 (Megatron) or continue with the rerun's clean result",
        ),
        (
            "--rerun-transient-budget",
            int,
            None,
            "continue: a device with more transients than N is a suspect, exit 17 (default: 2)",
        ),
    )
    switch(
        g,
        "--rewind-on-spike",
        "a spiky loss the rerun reproduces: restore the newest checkpoint, skip the window",
    )
    values(
        g,
        ("--rewind-skip-window", Int(1), 1, "iterations skipped per rewind, from the spike on"),
        (
            "--rewind-lr-scale",
            Float(gt=0.0, le=1.0),
            1.0,
            "multiply the learning rate by F after each rewind",
        ),
        ("--max-rewinds", Int(1), DEFAULT_MAX_REWINDS, "rewinds per run; later spikes train on"),
    )


def hang_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "reliability.hang", "reliability: hang detection (fault tolerance)")
    g.add_argument(
        "--enable-ft",
        "--enable-ft-package",
        dest="enable_ft",
        action="store_true",
        help="kill a rank stuck past its section's timeout (launcher restarts)",
    )
    g.add_argument(
        "--ft-timeouts",
        metavar="SPEC",
        help="section timeouts, seconds "
        "(default: setup=600,step=180,checkpointing=420,out_of_section=600)",
    )
    switch(g, "--calc-ft-timeouts", "learn timeouts from observed durations (<save>/ft_state.json)")
    g.add_argument(
        "--ft-num-warmup-iters", type=int, default=5, help="iterations before the step timeout"
    )


def exit_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "reliability.exit", "reliability: graceful exit")
    switch(g, "--exit-signal-handler", "--exit-signal on any rank: save (with --save), exit 0")
    g.add_argument("--exit-signal", default="SIGTERM", metavar="SIG", help="the exit signal")
    g.add_argument(
        "--exit-duration-in-mins",
        type=float,
        help="save and exit after this many minutes (default: no limit)",
    )
    g.add_argument(
        "--exit-interval", type=int, help="save and exit at multiples of N (default: off)"
    )
    g.add_argument(
        "--phase-transition-iterations",
        type=int,
        nargs="*",
        default=[],
        help="save and exit at these iterations",
    )
    g.add_argument(
        "--exit-on-interrupt",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Ctrl-C saves (with --save) and exits 130 (default: on for one process on a terminal)",
    )


def inprocess_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "reliability.inprocess", "reliability: in-process restart")
    switch(g, "--inprocess-restart", "after a fault, retrain in-process from the newest checkpoint")
    values(
        g,
        ("--inprocess-max-iterations", int, 3, "attempts before giving up"),
        ("--inprocess-soft-timeout", float, 60.0, "no progress for X seconds: restart"),
        ("--inprocess-hard-timeout", float, 90.0, "no progress for X seconds: kill"),
        ("--inprocess-heartbeat-interval", float, 1.0, "seconds between beats"),
        (
            "--inprocess-heartbeat-timeout",
            float,
            None,
            "a peer silent this long has failed (default: --inprocess-soft-timeout)",
        ),
        (
            "--inprocess-barrier-timeout",
            float,
            300.0,
            "seconds to wait for every rank at a restart's rendezvous",
        ),
        (
            "--inprocess-monitor-thread-interval",
            float,
            0.05,
            "seconds between the monitor thread's checks",
        ),
    )
    switch(
        g,
        "--inprocess-empty-cuda-cache",
        "Megatron's flag: the CUDA cache is always emptied (default: on)",
    )
    values(
        g,
        (
            "--inprocess-granularity",
            OneOf(RestartGranularity, "UNIT"),
            RestartGranularity.RANK,
            "restart unit",
        ),
    )


def fault_injection_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "reliability.faults", "reliability: fault injection (testing)")
    values(
        g,
        (
            "--inject-fault",
            OneOf(FaultKind, "KIND"),
            None,
            "fire once at --inject-fault-iteration (default: none)",
        ),
        ("--inject-fault-iteration", int, None, "iteration to fire at (as logged)"),
        ("--inject-fault-hang-seconds", float, None, "hang duration (default: forever)"),
        ("--inject-fault-rank", int, 0, "rank that fires"),
        ("--inject-fault-phase", OneOf(FAULT_PHASES, "PHASE"), "step", "where it fires"),
    )
    switch(g, "--inject-fault-repeat", "fire at every attempt, not once")


def _tensorboard_flags(g: Any) -> None:
    """TensorBoard (and W&B: the same keys) flags of the logging group, in Megatron spelling."""
    g.add_argument("--tensorboard-dir", metavar="DIR", help="TensorBoard events (default: none)")
    values(
        g,
        ("--tensorboard-log-interval", int, 1, "every N iterations"),
        ("--tensorboard-queue-size", int, 1000, "events buffered before a write"),
    )
    negated(
        g, "--no-log-loss-scale-to-tensorboard", "do not write the loss scale to TensorBoard/W&B"
    )
    switch(g, "--log-world-size-to-tensorboard", "also write the world size to TensorBoard/W&B")
    switch(g, "--group-metric-tags", "<group>/<key> tags (loss/lm loss), not Megatron's flat ones")
    switch(g, "--log-validation-ppl-to-tensorboard", "also write the validation perplexity")


def logging_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "observability.logging", "observability: logging")
    g.add_argument("--log-interval", type=int, default=10, help="log line every N iterations")
    values(
        g,
        (
            "--log-format",
            OneOf(LogFormat, "FORMAT"),
            LogFormat.COMPACT,
            "the log line (megatron: Megatron-LM's, for scrapers)",
        ),
    )
    g.add_argument(
        "--logging-level",
        type=LogLevel(),
        metavar="LEVEL",
        help="10-50 or a name, e.g. info (default: warnings, saves, loads)",
    )
    switch(g, "--verbose", "INFO lines too (= --logging-level INFO)")
    switch(
        g,
        "--log-throughput",
        "TFLOP/s per GPU in the log line (Megatron's field)",
    )
    g.add_argument(
        "--peak-tflops",
        type=Float(gt=0.0),
        metavar="TFLOPS",
        help="dense peak TFLOP/s per GPU for MFU (default: the table of known GPUs; none on CPU)",
    )
    switch(g, "--log-num-zeros-in-grad", "count zero gradients")
    switch(g, "--log-params-norm", "log the parameter norm")
    negated(g, "--no-progress-bar", "no progress bar (it shows on a terminal only)")
    negated(
        g,
        "--no-log-every-iteration",
        "no per-iteration rows (<metrics stem>.iterations.jsonl; the dashboards' per-iteration "
        "keys are then read at their own steps)",
    )
    switch(g, "--log-progress", "<save>/progress.txt line per persistent save (Megatron's format)")
    g.add_argument(
        "--metrics-file",
        metavar="FILE",
        help="one JSON object per log line (default: <run dir>/metrics.jsonl)",
    )
    g.add_argument(
        "--run-dir", metavar="DIR", help="where run artefacts and the report go (default: --save)"
    )
    _tensorboard_flags(g)
    g.add_argument("--wandb-project", metavar="NAME", help="W&B project (default: no W&B)")
    g.add_argument("--wandb-exp-name", metavar="NAME", help="W&B run name (default: W&B's)")
    g.add_argument("--wandb-save-dir", metavar="DIR", help="W&B files (default: W&B's)")
    wandb_modes = OneOf(("online", "offline", "disabled"), "MODE")
    values(g, ("--wandb-mode", wandb_modes, None, "W&B mode (default: W&B's)"))


def timer_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "observability.timers", "observability: timers")
    g.add_argument(
        "--timing-log-level",
        type=int,
        default=0,
        choices=(0, 1, 2),
        help="0: iteration time; 1: + forward-backward, optimizer; 2: + all",
    )
    values(
        g,
        ("--timing-log-option", OneOf(("max", "minmax", "all"), "HOW"), "minmax", "across ranks"),
        (
            "--timing-mode",
            OneOf(("sync", "events"), "MODE"),
            "sync",
            "sync: device syncs around timers; events: CUDA events",
        ),
    )
    switch(g, "--log-timers-to-tensorboard", "write timers to the sinks")


def straggler_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "observability.straggler", "observability: straggler detection")
    switch(g, "--log-straggler", "compare ranks' compute time every log line")
    switch(
        g,
        "--disable-straggler-on-startup",
        "start --log-straggler off; touch <run dir>/straggler.toggle turns it on or off",
    )
    values(
        g,
        ("--straggler-threshold", float, 1.2, "straggler: this x median time"),
        ("--straggler-minmax-count", int, 1, "name the N slowest and fastest ranks"),
    )


def memory_energy_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "observability.memory", "observability: memory")
    interval(g, "--log-memory-interval", "memory line")
    switch(g, "--log-memory-to-tensorboard", "write memory to the sinks")
    g.add_argument(
        "--empty-unused-memory-level",
        type=int,
        choices=(0, 1, 2),
        default=0,
        help="empty the CUDA cache: 1 after forward-backward and eval steps, 2 also after the "
        "optimizer (default: 0 = never)",
    )
    e = group(p, "observability.energy", "observability: energy")
    switch(e, "--log-energy", "energy and power per GPU (NVML)")


def dump_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "observability.dumps", "observability: dumps")
    g.add_argument("--dump-dir", metavar="DIR", help="where dumps go (default: the run dir)")
    for flag, what in (
        ("--save-activations-interval", "module inputs/outputs"),
        ("--save-dgrads-interval", "module input/output grads"),
        ("--save-wgrads-interval", "parameter grads (unclipped)"),
        ("--save-params-interval", "parameters (after the step)"),
        ("--save-tokens-per-expert-interval", "MoE tokens per expert"),
    ):
        interval(g, flag, what)
    switch(g, "--log-dgrads", "dgrads every --save-activations-interval (or --log-interval)")
    switch(g, "--log-tokens-per-expert", "tokens per expert, same cadence as --log-dgrads")
    switch(
        g,
        "--dump-stats-only",
        "per-module statistics instead of activation and --log-dgrads tensors",
    )


def profiler_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "observability.profiler", "observability: profiler")
    switch(g, "--profile", "profile from --profile-step-start + 1 to --profile-step-end")
    g.add_argument("--profile-step-start", type=int, default=10, help="window start")
    g.add_argument("--profile-step-end", type=int, default=12, help="window end")
    g.add_argument("--profile-ranks", type=int, nargs="+", default=[0], help="ranks to profile")
    switch(
        g,
        "--use-pytorch-profiler",
        "torch.profiler traces, else a cudaProfilerStart/Stop range (nsys)",
    )
    g.add_argument(
        "--profile-dir", metavar="DIR", help="where traces go (default: <run dir>/profile)"
    )


def _graph_impl(value: str) -> str:
    """``--cuda-graph-impl``: Megatron's per-layer values refused saying why (the choices
    check names the allowed ones for anything else)."""
    if value in ("local", "transformer_engine"):
        raise argparse.ArgumentTypeError(
            f"{value} (Megatron's per-layer graphs) is not implemented by stalwart, which graphs "
            "the whole iteration; allowed: none, full_iteration"
        )
    return value


def graph_flags(p: argparse.ArgumentParser) -> None:
    g = group(p, "graphs", "CUDA graphs")
    g.add_argument(
        "--cuda-graph-impl",
        type=_graph_impl,
        choices=("none", "full_iteration"),
        default="none",
        metavar="IMPL",
        help="full_iteration: all micro-batches' forward-backward in one graph",
    )
    switch(g, "--optimizer-cuda-graph", "capture clip + AdamW as a graph")
    g.add_argument(
        "--cuda-graph-warmup-steps", type=int, default=3, help="eager iterations before capture"
    )
    g.add_argument(
        "--cuda-graph-speculative-launch",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="launch the next iteration's graph before this one's check",
    )
    switch(
        g,
        "--cuda-graph-include-optimizer",
        "with full_iteration: clip + fused AdamW inside the full-iteration graph (one "
        "graph per iteration, no speculative launch)",
    )
