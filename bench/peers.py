"""Benchmark (issue 45): stalwart's trainer against the trainers users pick instead, one GPU.

The same model (a ``llama-*`` preset; Llama 3.2 1B's shape at ``llama-1b``), the same synthetic
tokens (one uint32 file of uniform random ids, read by each trainer's own data path), the same
micro-batch, global batch and sequence, one after another, each trainer in its own subprocess
(its own compile caches, a cold Inductor cache, its own memory):

* ``stalwart``: ``stalwart train`` (the CLI, in-process in the child) with compiled full-iteration
  graphs (``--compile --cuda-graph-impl full_iteration --optimizer-cuda-graph``: the fast path,
  the same numerics as eager) and every check on (``--check-for-spiky-loss
  --check-for-large-grads`` beside the default NaN/Inf checks); ``stalwart-bf16-residual`` adds
  the numerics switch ``--bf16-residual-connection`` (torchtitan's bf16 parameters run a bf16
  residual stream too);
* ``torchtitan``: torchtitan 0.3.0's own ``Trainer`` (``bench/peer_titan.py``): its Llama 3 model
  at the same shape, ``compile.enable`` (model and loss), its fwd+bwd CUDA graph (on by default),
  no activation checkpointing, the chunked loss of its Llama recipes, bf16 mixed precision; a
  synthetic data loader and tokenizer in its ``Configurable`` slots. Where it cannot run on this
  torch, the table says why and ``torchtitan-fallback`` runs its model with its own
  ``parallelize_llama`` (which applies ``apply_compile`` and FSDP's mixed precision) in its
  documented training step;
* ``hf``: the Hugging Face ``Trainer`` on ``LlamaForCausalLM`` (``sdpa``, ``bf16=True``,
  ``torch_compile=True``, ``adamw_torch_fused``).

Timing is the same for all: after ``--warmup`` iterations, windows of ``--window`` iterations
from a device sync to a device sync, ``--iters`` in all, taken in each trainer's own per-step
hook; the figure is the median window, the spread min-max. Tokens/s = global batch x sequence /
time; MFU = one FLOP formula for all (stalwart's ``num_floating_point_operations``: 6 x the
matmul parameters (the tied output layer once) + 12 x layers x sequence x hidden per token, the
attention square counted whole, as PaLM and torchtitan count it) / the card's dense bf16 peak
(``stalwart.observability.throughput``: 989.4 TFLOP/s for the H100 and H200). Peak memory:
``torch.cuda.max_memory_allocated`` / ``reserved`` in the child; time to the first iteration:
from the child's launch to the end of iteration 1 (imports, model, compile; the cold Inductor
cache). Then ``--profile-iters`` iterations under torch.profiler (stalwart: its own ``--profile
--use-pytorch-profiler``), summarised from the Chrome traces (``bench/trace_gaps.py``):
device busy and idle per iteration, time by kernel kind, the top kernels and idle gaps.

    PYTHONPATH=src python3 bench/peers.py --out $OUT/llama-1b                 # H100, ~8 min
    PYTHONPATH=src python3 bench/peers.py --preset gpt2-124m --peers stalwart \\
        --micro-batch-size 32 --global-batch-size 32 --out $OUT/gpt2          # gpt2, profiled
    PYTHONPATH=src python3 bench/peers.py --smoke --out /tmp/peers            # CPU, seconds
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from peer_common import PEER_MODULES, Spec, model_config
from peer_report import markdown_table, print_profiles, summarize

BENCH = Path(__file__).resolve().parent
SRC = BENCH.parent / "src"
SMOKE_SHAPE = [
    "--num-layers",
    "1",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--num-query-groups",
    "2",
    "--ffn-hidden-size",
    "96",
    "--vocab-size",
    "512",
    "--seq-length",
    "32",
]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="llama-1b")
    p.add_argument("--peers", default="stalwart,torchtitan,hf", help=f"of {sorted(PEER_MODULES)}")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--global-batch-size", type=int, default=16)
    p.add_argument("--warmup", type=int, default=6, help="untimed iterations (compile, capture)")
    p.add_argument("--iters", type=int, default=12, help="timed iterations")
    p.add_argument("--window", type=int, default=2, help="iterations per timed window")
    p.add_argument("--profile-iters", type=int, default=2, help="0: no profile")
    p.add_argument(
        "--profile-peers",
        default="stalwart,stalwart-bf16-residual,torchtitan,torchtitan-fallback",
        help="the peers profiled after their timed iterations",
    )
    p.add_argument("--log-interval", type=int, default=10, help="each trainer's own logging")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--budget-s", type=float, default=440.0, help="all peers; later ones skip")
    p.add_argument("--peer-timeout-s", type=float, default=300.0)
    p.add_argument("--out", default="runs/peers", help="table, JSON and traces (8 files at most)")
    p.add_argument("--smoke", action="store_true", help="CPU, a tiny shape, no compile (a test)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # internal: run one peer
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def make_spec(args: argparse.Namespace, work: Path) -> Spec:
    smoke = args.smoke
    model_flags = ["--preset", "llama-tiny" if smoke else args.preset]
    model_flags += SMOKE_SHAPE if smoke else []
    return Spec(
        model_flags=model_flags,
        micro_batch_size=2 if smoke else args.micro_batch_size,
        global_batch_size=4 if smoke else args.global_batch_size,
        warmup=1 if smoke else args.warmup,
        iters=2 if smoke else args.iters,
        window=1 if smoke else args.window,
        profile_iters=1 if smoke else args.profile_iters,
        log_interval=args.log_interval,
        lr=args.lr,
        device="cpu" if smoke else "cuda",
        compile=not smoke,
        tokens_path=str(work / "tokens.bin"),
        work_dir=str(work),
        profile_peers=list(PEER_MODULES) if smoke else args.profile_peers.split(","),
    )


def write_tokens(spec: Spec) -> None:
    """Uniform random token ids, uint32, enough windows for every iteration (plus slack)."""
    cfg = model_config(spec)
    samples = (spec.total_iterations + 2) * spec.global_batch_size
    # stalwart holds 2% out for validation: that split needs a window too
    count = max(int(samples * 1.1 + 2), 60) * cfg.seq_length + 1
    rng = np.random.default_rng(1234)
    rng.integers(0, cfg.vocab_size, size=count, dtype=np.uint32).tofile(spec.tokens_path)


def run_peer(peer: str, spec: Spec, timeout: float, note: str | None = None) -> dict[str, Any]:
    """One peer in its own process; its result JSON (or what went wrong)."""
    peer_dir = Path(spec.work_dir) / peer
    peer_dir.mkdir(parents=True, exist_ok=True)
    spec_path, result_path = peer_dir / "spec.json", peer_dir / "result.json"
    spec_path.write_text(json.dumps(spec.__dict__))
    env = dict(os.environ, PYTHONUNBUFFERED="1", PEERS_T0=repr(time.time()))
    env["PYTHONPATH"] = os.pathsep.join([str(SRC), *_search_path(peer)])
    env["TORCHINDUCTOR_CACHE_DIR"] = str(peer_dir / "inductor")  # cold: each compiles anew
    env["TRITON_CACHE_DIR"] = str(peer_dir / "triton")
    cmd = [sys.executable, str(BENCH / "peers.py"), "--child", peer, "--spec", str(spec_path)]
    cmd += ["--result", str(result_path)]
    print(f"\n== {peer}: {' '.join(cmd[1:3])} (timeout {timeout:.0f} s)", flush=True)
    start = time.perf_counter()
    log = peer_dir / "log.txt"
    with open(log, "w") as fh:
        # Its own process group: a timeout also ends its compile workers.
        proc = subprocess.Popen(
            cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            code: int | str = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = f"timed out after {timeout:.0f} s"
    result: dict[str, Any] = {"peer": peer}
    if result_path.exists():
        result = json.loads(result_path.read_text())
    if code != 0 and result.get("partial"):
        result["error"] = f"exit {code} after {len(result.get('windows_ms', []))} windows"
    if code != 0 and not result.get("windows_ms"):
        tail = log.read_text(errors="replace")[-1500:]
        result.setdefault("error", f"exit {code}: {tail.strip().splitlines()[-1] if tail else ''}")
        print(tail, flush=True)
    if note:
        result["note"] = note
    result["wall_s"] = round(time.perf_counter() - start, 1)
    print(
        json.dumps({k: v for k, v in result.items() if k not in ("windows_ms", "profile")}),
        flush=True,
    )
    return result


def run_all(args: argparse.Namespace, spec: Spec) -> list[dict[str, Any]]:
    """Each peer while the budget lasts (its timeout: what is left; skipped under a minute); a
    torchtitan trainer that cannot run is followed by its fallback. ``--smoke``: the peers at
    once (CPU processes; the figures mean nothing)."""
    queue = [p.strip() for p in args.peers.split(",") if p.strip()]
    skipped = [{"peer": p, "error": why} for p in queue if (why := _cannot_run(p, spec))]
    queue = [p for p in queue if not _cannot_run(p, spec)]
    if args.smoke:
        with ThreadPoolExecutor(max(1, len(queue))) as pool:
            return [*pool.map(lambda p: run_peer(p, spec, args.peer_timeout_s), queue), *skipped]
    end = time.perf_counter() + args.budget_s
    results, notes = skipped, {}
    while queue:
        peer = queue.pop(0)
        left = end - time.perf_counter()
        if left < 60.0:
            results.append({"peer": peer, "error": f"skipped: {left:.0f} s of the budget left"})
            continue
        result = run_peer(peer, spec, min(args.peer_timeout_s, left), notes.get(peer))
        results.append(result)
        why = str(result.get("error", "no timings"))
        if peer == "torchtitan" and not result.get("windows_ms") and _fallback_can_run(why):
            queue.insert(0, "torchtitan-fallback")
            notes["torchtitan-fallback"] = f"run because torchtitan's trainer did not: {why}"
            print(f"torchtitan's trainer did not run here: {why}", flush=True)
    return results


def _search_path(peer: str) -> list[str]:
    """``PYTHONPATH`` for ``peer``'s process: the carried torchtitan wheels (and the packages they
    bring: ``datasets``, ``tyro``, ...) only for the torchtitan peers, so the others import what
    they would without them."""
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if peer.startswith("torchtitan"):
        return paths
    return [p for p in paths if not (Path(p) / "torchtitan").is_dir()]


def _cannot_run(peer: str, spec: Spec) -> str | None:
    """Why ``peer`` is skipped without a process (torchtitan: not installed, or no GPU)."""
    if not peer.startswith("torchtitan"):
        return None
    if importlib.util.find_spec("torchtitan") is None:
        return "skipped: torchtitan is not installed (carry its wheels: bench/peers.py's docstring)"
    if spec.device != "cuda":
        return "skipped: torchtitan's trainer needs CUDA (its device is torch.cuda's)"
    return None


def _fallback_can_run(error: str) -> bool:
    """The fallback runs torchtitan's model on CUDA: not where torchtitan is not installed or
    there is no GPU."""
    return "No module named 'torchtitan" not in error and "needs CUDA" not in error


def _bundle(out: Path, spec: Spec, results: list[dict[str, Any]]) -> None:
    """The peers' traces and logs, gzipped, into one archive (the device returns 8 files)."""
    with tarfile.open(out / "traces.tar.gz", "w:gz") as tar:
        for r in results:
            trace, log = Path(r.get("trace") or "-"), Path(spec.work_dir) / r["peer"] / "log.txt"
            if trace.is_file():
                tar.add(trace, arcname=f"{r['peer']}-trace.json")
            if log.is_file():
                tar.add(log, arcname=f"{r['peer']}-log.txt")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.child:
        from peer_common import run_child

        return run_child(args.child, Path(args.spec), Path(args.result))
    unknown = [p for p in args.peers.split(",") if p.strip() and p.strip() not in PEER_MODULES]
    if unknown:
        raise SystemExit(f"--peers: unknown {unknown}; allowed: {sorted(PEER_MODULES)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="peers-"))
    try:
        spec = make_spec(args, work)
        write_tokens(spec)
        results = run_all(args, spec)
        report = summarize(spec, results)
        table = markdown_table(report)
        print("\n" + table, flush=True)
        print_profiles(report)
        (out / "peers.md").write_text(table)
        (out / "peers.json").write_text(json.dumps(report, indent=1, default=str))
        _bundle(out, spec, results)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
