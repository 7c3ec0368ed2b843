"""Benchmark: time to attribute a persistent fault with the peer replay vs the exit-16 relaunch.

Both flows start from the same event: rank 1's iteration is rejected and the in-place rerun
reproduces it (``--error-injection-type persistent_error`` on rank 1). Measured per round, with
the reference trainer on CPU under torchrun (gloo, ``tiny`` preset):

* ``peer``: the launch that meets the fault, with ``--rerun-peer-replay``: the seconds from the
  agreed rejection to the agreed verdict, as the machine logs them ("Peer replay verdict X s
  after the rejection": the in-place rerun, the shipping collective, the replay and the verdict
  collective), and the iteration time of that launch (median ``elapsed_ms`` before the fault);
* ``relaunch``: what the exit-16 flow needs at least once more before it can decide (Megatron
  reruns the iteration after a relaunch elsewhere): a torchrun relaunch on the checkpoint the
  first launch saved, from ``torchrun`` starting to its first logged training iteration
  (interpreter, ``import torch``, rendezvous, process groups, model build, checkpoint load and
  one iteration). No scheduler queueing is included: the real relaunch costs more.

Reported per world size: median (min-max) of each over ``--repeats`` rounds, and the target of
issue 15 (verdict <= 2 x iteration + 1 s).

    python bench/peer_replay.py --worlds 2 4 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

FAULT_ITERATION = 4  # as logged
TINY = ["--preset", "tiny", "--use-cpu", "--no-progress-bar", "--num-layers", "2",
        "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "64",
        "--vocab-size", "512", "--micro-batch-size", "2", "--log-interval", "1"]  # fmt: skip
VERDICT = re.compile(r"Peer replay verdict ([0-9.]+) s after the rejection")
ITERATION_LINE = re.compile(r"iteration\s+(\d+)/")


def _launch(
    world: int, flags: list[str], env: dict[str, str]
) -> tuple[list[tuple[float, str]], int]:
    """Run torchrun; every output line with its seconds since the launch started."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(world), "-m", "stalwart", "train", *flags]  # fmt: skip
    inherited = {k: v for k, v in os.environ.items() if k != "STALWART_DEVICE_ID"}
    # TORCH_DISABLE_SHARE_RDZV_TCP_STORE: see tests/distributed/test_rerun_torchrun.py.
    full_env = {**inherited, "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    full_env.update(env)
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=full_env
    )
    assert proc.stdout is not None
    lines = [(time.monotonic() - start, line.rstrip()) for line in proc.stdout]
    return lines, proc.wait()


def _elapsed_ms(metrics: str) -> list[float]:
    out = []
    with open(metrics, encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            if "elapsed_ms" in rec and 1 < int(rec.get("iteration", 0)) < FAULT_ITERATION:
                out.append(float(rec["elapsed_ms"]))
    return out


def one_round(world: int, tmp: str) -> dict[str, float]:
    save, metrics = os.path.join(tmp, "ckpt"), os.path.join(tmp, "metrics.jsonl")
    common = [*TINY, "--global-batch-size", str(2 * world), "--save", str(save)]
    fault = ["--train-iters", "6", "--metrics-file", metrics, "--rerun-peer-replay",
             "--error-injection-rate", "1", "--error-injection-type", "persistent_error",
             "--error-injection-iterations", str(FAULT_ITERATION), "--error-injection-ranks", "1"]  # fmt: skip
    lines, code = _launch(world, [*common, *fault], {})
    text = "\n".join(line for _, line in lines)
    found = VERDICT.search(text)
    if found is None:
        raise RuntimeError(f"no peer replay verdict (exit {code}):\n{text[-3000:]}")
    iteration_ms = statistics.median(_elapsed_ms(metrics))
    # The exit-16 flow's relaunch, on the checkpoint just saved, on "other hardware".
    lines, code = _launch(
        world, [*common, "--train-iters", "6"], {"STALWART_DEVICE_ID": "bench-other"}
    )
    first = next((t for t, line in lines if ITERATION_LINE.search(line)), None)
    if first is None:
        raise RuntimeError(f"the relaunch logged no iteration (exit {code})")
    return {"verdict_s": float(found.group(1)), "iteration_ms": iteration_ms, "relaunch_s": first}


def _summary(values: list[float]) -> list[float]:
    return [statistics.median(values), min(values), max(values)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    out: dict[str, dict[str, list[float]]] = {}
    for world in args.worlds:
        rounds = []
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as tmp:
                rounds.append(one_round(world, tmp))
        out[str(world)] = {k: _summary([r[k] for r in rounds]) for k in rounds[0]}
        v, it, rl = (out[str(world)][k] for k in ("verdict_s", "iteration_ms", "relaunch_s"))
        target = 2 * it[0] / 1e3 + 1.0
        print(f"{world} ranks: peer replay verdict {v[0]:.2f} s ({v[1]:.2f}-{v[2]:.2f}); "
              f"iteration {it[0]:.0f} ms ({it[1]:.0f}-{it[2]:.0f}); target <= {target:.2f} s; "
              f"torchrun relaunch to first step {rl[0]:.1f} s ({rl[1]:.1f}-{rl[2]:.1f}): "
              f"{rl[0] / v[0]:.0f}x")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
