#!/usr/bin/env bash
# The whole GPU check in one call (device machine, repo root; torch from the machine's python3):
# GPU tests, trainer smoke runs (full-iteration graphs, in-graph validation with an injected
# fault), and the GPU benchmarks side by side. Everything lands in one archive $OUT/gpu_check.tgz
# (the device tool returns at most 8 files) and the tables are printed at the end.
#   OUT=/tmp/out bash scripts/gpu_check.sh            # full check
#   QUICK=1 OUT=/tmp/out bash scripts/gpu_check.sh    # fewer benchmark rounds
#   STEPS="gpu_tests memory" OUT=... bash scripts/gpu_check.sh   # only the named steps
#   STEPS=bench_graphs_compiled OUT=... bash scripts/gpu_check.sh  # opt-in: torch.compile variants
# On a two-GPU machine the two-GPU tests add about 3 minutes: split long runs with STEPS to stay
# within one 10-minute device call. BUDGET (seconds, default 560) caps the whole call: a step is
# cut to what is left and skipped when under 20 s remain, and the archive is rewritten after
# every step, so a call that runs out still brings back every finished step.
#   STEPS=compat_cpu ...   # the CPU test suite (no GPU tests) on the device's torch, 16 workers
set -uo pipefail
OUT="${OUT:-runs/gpu_check}"
WORK="$(mktemp -d)"; SCRATCH="$(mktemp -d)"  # checkpoints go to SCRATCH (not archived)
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
ROUNDS="${ROUNDS:-3}"; ITERS="${ITERS:-10}"
[ -n "${QUICK:-}" ] && { ROUNDS=2; ITERS=6; }
start=$(date +%s); BUDGET="${BUDGET:-560}"
FAILED=()  # "NAME rc=N (expected M)" of every step that ended otherwise
run_step() {  # run_step EXPECTED_RC NAME TIMEOUT CMD... ; output in $WORK/NAME.log, rc in summary
  local expect=$1 name=$2 limit=$3; shift 3
  if [ -n "${STEPS:-}" ] && [[ " $STEPS " != *" $name "* ]]; then return 0; fi
  local left=$(( BUDGET - ($(date +%s) - start) - 10 ))
  if [ "$left" -lt 20 ]; then echo "$name skipped (budget)" | tee -a "$WORK/summary.txt"; return 0; fi
  [ "$limit" -gt "$left" ] && limit=$left
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$WORK/$name.log" 2>&1
  local rc=$? verdict=ok
  if [ "$rc" -ne "$expect" ]; then verdict="FAILED (expected rc=$expect)"; FAILED+=("$name rc=$rc (expected $expect)"); fi
  echo "$name rc=$rc $(( $(date +%s) - t0 ))s (limit ${limit}s) $verdict" | tee -a "$WORK/summary.txt"
  tar czf "$OUT/gpu_check.tgz" -C "$WORK" .  # what came back so far, if the call is cut
}
step() { run_step 0 "$@"; }  # step NAME TIMEOUT CMD...: a step that must exit 0
python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())" \
  | tee "$WORK/env.log"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,memory.used --format=csv >>"$WORK/env.log" 2>&1

# The CPU suite on the device's torch (2.11) and Python (3.12): the package must keep working
# there. Opt-in (STEPS=compat_cpu); the slow multi-process tests are left to CI.
[[ " ${STEPS:-} " == *" compat_cpu "* ]] && step compat_cpu 300 env CUDA_VISIBLE_DEVICES= \
  python3 -m pytest -q -x -n 12 -m "not gpu and not slow" -p no:cacheprovider tests
# -s: the tests print their measured differences; two-GPU tests skip on a one-GPU machine.
# GPU_PYTEST_ARGS: e.g. "-n 3" (pytest-xdist, carried as a wheel) to share the card; the opt-in
# gpu_tests_again runs the suite a second time in a row (each must exit on its own: timeout kills
# a pytest that hangs at exit, and the step fails).
step gpu_tests 540 python3 -m pytest -q -s -rfs -m gpu -p no:cacheprovider ${GPU_PYTEST_ARGS:-} tests
[[ " ${STEPS:-} " == *" gpu_tests_again "* ]] && step gpu_tests_again 540 python3 -m pytest -q -rfs \
  -m gpu -p no:cacheprovider ${GPU_PYTEST_ARGS:-} tests
# The straggler detector's NVML fields (temperature, power, utilisation, clock): a missing pynvml
# fails this step (in gpu_tests it is a skip). The image has nvidia-ml-py (KINDS.md); else carry
# its wheel as the device README says.
step nvml_straggler 90 env STALWART_REQUIRE_NVML=1 python3 -m pytest -q -s -rfs -m gpu \
  -p no:cacheprovider tests/gpu/test_straggler_nvml_gpu.py
TRAIN=(python3 -m stalwart train --preset tiny --bf16 --train-iters 30 --log-interval 10 --no-progress-bar)
# The trainer's log line with Megatron's GPU fields (MnPwr/Rnk ... MxClk/Rnk), tokens/s and MFU.
step train_straggler_nvml 120 "${TRAIN[@]}" --log-straggler --metrics-file "$WORK/straggler_metrics.jsonl"
# The runs resumed across modes below and their resumes share one schedule (decay end 40): a
# resume with --train-iters 40 keeps the checkpoint's schedule, so Megatron's rule accepts it,
# and the learning rate is not yet at its minimum (0) over the 10 resumed iterations.
SCHEDULE=(--lr-decay-iters 40)
# Evaluation every 10 iterations: under graphs the evaluation stage warms up, captures, replays.
step train_graphs 120 "${TRAIN[@]}" --cuda-graph-impl full_iteration --optimizer-cuda-graph \
  --eval-interval 10 --eval-iters 6 "${SCHEDULE[@]}" \
  --save "$SCRATCH/ckpt_graphs" --metrics-file "$WORK/graphs_metrics.jsonl"
# --optimizer-cuda-graph on its own: the optimizer graph over an eager forward-backward (Megatron).
step train_optimizer_graph 120 "${TRAIN[@]}" --optimizer-cuda-graph --eval-interval 10 --eval-iters 6 \
  --metrics-file "$WORK/optimizer_graph_metrics.jsonl"
step train_eager 120 "${TRAIN[@]}" --eval-interval 10 --eval-iters 6 "${SCHEDULE[@]}" \
  --save "$SCRATCH/ckpt_eager" --metrics-file "$WORK/eager_metrics.jsonl"
# Resume across modes on the device: the eager checkpoint (iteration 30) continues under graphs and
# the graphed one eagerly, 10 more iterations each (optimizer state keeps the running implementation).
step train_resume_eager_to_graphs 120 "${TRAIN[@]}" --train-iters 40 "${SCHEDULE[@]}" --load "$SCRATCH/ckpt_eager" \
  --cuda-graph-impl full_iteration --optimizer-cuda-graph --metrics-file "$WORK/resume_e2g_metrics.jsonl"
step train_resume_graphs_to_eager 120 "${TRAIN[@]}" --train-iters 40 "${SCHEDULE[@]}" --load "$SCRATCH/ckpt_graphs" \
  --metrics-file "$WORK/resume_g2e_metrics.jsonl"
# A Llama model (RoPE, RMSNorm, SwiGLU, GQA, untied) with full recompute inside the graphs.
step train_llama_graphs 150 "${TRAIN[@]}" --preset llama-tiny --cuda-graph-impl full_iteration \
  --optimizer-cuda-graph --recompute-granularity full --recompute-method uniform \
  --recompute-num-layers 1 --metrics-file "$WORK/llama_graphs_metrics.jsonl"
# A real divergence (the largest LR --lr accepts, no warm-up, bf16): the machine finds Inf/NaN,
# reruns, finds it reproducible, saves and exits 16 (rc 16 expected). With the speculative
# launch (default) the next iteration was already launched when the fault is read; without it
# (--no-...) the run must end the same way.
DIVERGE=(--cuda-graph-impl full_iteration --optimizer-cuda-graph --cuda-graph-warmup-steps 1
  --lr 10 --lr-warmup-iters 1 --train-iters 60 --log-interval 1)
run_step 16 train_diverge_speculative 120 "${TRAIN[@]}" "${DIVERGE[@]}" --save "$SCRATCH/div_spec"
run_step 16 train_diverge_plain 120 "${TRAIN[@]}" "${DIVERGE[@]}" --no-cuda-graph-speculative-launch \
  --save "$SCRATCH/div_plain"
# Every validation call is corrupted once (transient): the in-graph check must catch it, skip the
# optimizer replay, replay the iteration, find it not reproducible and exit 17.
run_step 17 train_graphs_injected 120 "${TRAIN[@]}" --cuda-graph-impl full_iteration --optimizer-cuda-graph \
  --error-injection-rate 1 --error-injection-type transient_error --error-injection-iterations 13 \
  --result-rejected-tracker-filename "$WORK/tracker.txt"
# New since the last GPU run: DataLoader workers with pinned memory, a CUDA profiler window,
# the replica check's cost (nothing to compare on one GPU: fingerprints + host read vs a step).
step train_workers_profile 120 "${TRAIN[@]}" --num-workers 2 --profile --use-pytorch-profiler \
  --profile-step-start 10 --profile-step-end 12 --profile-dir "$SCRATCH/profile" \
  --check-weight-hash-across-dp-replicas-interval 10 --manual-gc --manual-gc-interval 10
cp "$SCRATCH"/profile/ops_*.txt "$WORK"/ 2>/dev/null  # the trace itself is large: table only
step replica_check 120 python3 bench/replica_check.py --preset gpt2-124m --device cuda --bf16 \
  --json "$WORK/replica_check.json"
# The in-step sampled fingerprint of weights + all-reduced gradients (issue 15: <= 0.5%).
step replica_sampled 180 python3 bench/replica_check.py --preset gpt2-124m --device cuda --bf16 \
  --sample-fraction 0.01 --iters 100 --json "$WORK/replica_sampled.json"
# The same fingerprint (sampled 1% and full) against it truly off, side by side in one process,
# under full-iteration graphs (tight spread) then eager, variants rotating per round (~110 s).
step bench_fingerprint 150 python3 bench/fingerprint_overhead.py --device cuda --bf16 \
  --preset gpt2-124m --json "$WORK/fingerprint_overhead.json"
# Opt-in (gpu_tests runs it too): the peer replay's determinism test alone.
[[ " ${STEPS:-} " == *" peer_replay_gpu "* ]] && step peer_replay_gpu 120 python3 -m pytest -q -s \
  -rfs -m gpu -p no:cacheprovider tests/gpu/test_peer_replay_gpu.py

# Library-level graph benchmark (bench/graphs.py): every variant but the torch.compile ones
# (those take minutes to compile: STEPS=bench_graphs_compiled).
step bench_graphs 300 python3 bench/graphs.py --variants \
  eager,graph,graph_fused_adamw,graph_validation,graph_validation_sync,graph_validation_noread,graph_validation_lagged,graph_guarded \
  --json "$WORK/bench_graphs.json"
# Opt-in (minutes of Inductor compiles; would push the default run past one 10-minute call).
[[ " ${STEPS:-} " == *" bench_graphs_compiled "* ]] && step bench_graphs_compiled 540 python3 bench/graphs.py --variants \
  graph,graph_compiled,graph_compiled_fused_adamw,compile_reduce_overhead,compile_reduce_overhead_fused_adamw \
  --json "$WORK/bench_graphs_compiled.json"
# Issue 19's kernel floor, opt-in (~5 min): the ingredients' GPU tests (real capture), a tiny run
# with all three under graphs, and bench/kernel_floor.py (graph + compiled with each ingredient
# vs torch.compile reduce-overhead, side by side; the profiler's kernel sum vs wall):
# (the bench first: the figures; the steps after it get what is left of BUDGET)
#   STEPS="kernel_floor kernel_floor_tests train_kernel_floor" BUDGET=330 OUT=... bash scripts/gpu_check.sh
[[ " ${STEPS:-} " == *" kernel_floor "* ]] && step kernel_floor 240 python3 bench/kernel_floor.py \
  --presets small,gpt2-124m --budget-s 200 --trainer-iters 0 --json "$WORK/kernel_floor.json"
# The whole kernel-floor table in two calls of <= 540 s (each alone: STEPS=<one>, BUDGET=540):
# every variant at gpt2-124m and the trainer's TFLOP/s there (--trainer-iters 150, all checks),
# then every variant at small and tiny. A 5-minute probe: the best set against all three at
# gpt2-124m (does the launch ahead explain the idle time?), with the device idle gaps, then the
# ingredients' GPU tests in what is left:
#   STEPS="kernel_floor_probe kernel_floor_tests" BUDGET=300 OUT=... bash scripts/gpu_check.sh
[[ " ${STEPS:-} " == *" kernel_floor_gpt2 "* ]] && step kernel_floor_gpt2 530 python3 \
  bench/kernel_floor.py --presets gpt2-124m --budget-s 490 --trainer-iters 150 \
  --trainer-timeout-s 150 --json "$WORK/kernel_floor_gpt2.json"
[[ " ${STEPS:-} " == *" kernel_floor_small_tiny "* ]] && step kernel_floor_small_tiny 530 python3 \
  bench/kernel_floor.py --presets small,tiny --budget-s 490 --trainer-iters 0 \
  --json "$WORK/kernel_floor_small_tiny.json"
[[ " ${STEPS:-} " == *" kernel_floor_probe "* ]] && step kernel_floor_probe 240 python3 \
  bench/kernel_floor.py --presets gpt2-124m --variants reduce_overhead,weights_residual,all,today \
  --rounds 4 --budget-s 200 --trainer-iters 0 --json "$WORK/kernel_floor_probe.json"
[[ " ${STEPS:-} " == *" kernel_floor_tests "* ]] && step kernel_floor_tests 150 python3 -m pytest \
  -q -s -rfs -m gpu -p no:cacheprovider tests/gpu/test_kernel_floor_gpu.py \
  tests/gpu/test_cross_entropy_fusion_gpu.py
# The fused output layer + loss alone against the compiled unfused one, and the loss kernel per
# block configuration (--cross-entropy-loss-fusion; opt-in, ~1 min).
[[ " ${STEPS:-} " == *" bench_cross_entropy "* ]] && step bench_cross_entropy 150 python3 \
  bench/cross_entropy_fusion.py --kernel-only --json "$WORK/cross_entropy_fusion.json"
[[ " ${STEPS:-} " == *" train_kernel_floor "* ]] && step train_kernel_floor 90 "${TRAIN[@]}" \
  --cuda-graph-impl full_iteration --cuda-graph-include-optimizer --bf16-compute-weights \
  --bf16-residual-connection --eval-interval 10 --eval-iters 6 \
  --metrics-file "$WORK/kernel_floor_metrics.jsonl"
# The trainer with and without the speculative launch (subprocesses, alternating).
step bench_speculative 300 bash -c "python3 bench/speculative_launch.py --preset tiny --json $WORK/spec_tiny.json && python3 bench/speculative_launch.py --preset tiny --extra '--global-batch-size 32' --json $WORK/spec_tiny4.json && python3 bench/speculative_launch.py --preset small --iters 200 --log-interval 25 --json $WORK/spec_small.json"
# What the checks cost the guarded step, eager and graphed, against the checks truly off.
step bench_checks 300 python3 bench/check_overhead.py --device cuda --bf16 \
  --presets "${CHECK_PRESETS:-tiny,small,gpt2-124m}" --json "$WORK/check_overhead.json"
# Every iteration's row (the device ring) against the per-iteration rows truly off (issue 44).
step bench_iteration_log 240 python3 bench/iteration_log_overhead.py --device cuda --bf16 \
  --presets gpt2-124m --modes "${LOG_MODES:-graphed,eager}" --rounds "${LOG_ROUNDS:-8}" \
  --json "$WORK/iteration_log.json"
# A non-persistent snapshot every 10 iterations against none (issue 43: at most 1%).
step bench_local_snapshot 240 python3 bench/local_snapshot.py --device cuda --bf16 \
  --preset gpt2-124m --rounds "${SNAPSHOT_ROUNDS:-10}" --json "$WORK/local_snapshot.json"
# Opt-in: what the checks launch per iteration (kernels, ops, syncs), off vs on.
[[ " ${STEPS:-} " == *" bench_check_ops "* ]] && step bench_check_ops 240 python3 bench/check_ops.py \
  --device cuda --bf16 --presets tiny,small,gpt2-124m -v --json "$WORK/check_ops.json"
BENCH=(python3 bench/step_bench.py --device cuda --bf16 --rounds "$ROUNDS" --iters "$ITERS")
step bench_tiny 150 "${BENCH[@]}" --preset tiny --suite baseline,timers,dumps,graphs --json "$WORK/bench_tiny.json"
step bench_small 150 "${BENCH[@]}" --preset small --suite baseline,timers,graphs --json "$WORK/bench_small.json"
step bench_gpt2 200 "${BENCH[@]}" --preset gpt2-124m --suite baseline,timers,dumps --json "$WORK/bench_gpt2.json"
step bench_dumps 120 "${BENCH[@]}" --preset gpt2-124m --suite dumps --json "$WORK/bench_dumps.json"
# Every preset (llama-* included) x recompute none/selective/full x bf16/fp32: 30 measurements.
step memory 420 python3 bench/memory_check.py --device cuda --json "$WORK/memory.json"
step ckpt_save 200 python3 bench/checkpoint_save.py --preset gpt2-124m --device cuda --json "$WORK/ckpt_save.json"

echo "== total $(( $(date +%s) - start ))s" | tee -a "$WORK/summary.txt"
tar czf "$OUT/gpu_check.tgz" -C "$WORK" .
for f in "$WORK"/train_*.log; do
  echo "== $f"; grep -i "validation loss" "$f" | tail -3; grep -v DEBUG "$f" | tail -6
done
for f in "$WORK"/bench_*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -A 40 "^preset=" "$f" | grep -v "DEBUG\|INFO\|WARN" | tail -25; }
done
for f in "$WORK"/memory.log "$WORK"/ckpt_save.log "$WORK"/replica_check.log "$WORK"/replica_sampled.log; do
  [ -f "$f" ] && { echo "== $f"; grep -v "DEBUG\|INFO\|WARN\|^\[rank" "$f" | tail -14; }
done
[ -f "$WORK/train_straggler_nvml.log" ] && { echo "== train_straggler_nvml"; grep -oE "MnPwr/Rnk.*MxClk/Rnk: [^|]*|tokens per second: .*" "$WORK/train_straggler_nvml.log" | tail -4; }
[ -f "$WORK/nvml_straggler.log" ] && { echo "== nvml_straggler"; grep -E "NVML|straggler GPU|passed|failed|SKIPPED|Error" "$WORK/nvml_straggler.log" | cut -c1-400; }
for f in "$WORK"/train_diverge_*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "Unexpected result|reproducible|exit reason" "$f" | cut -c1-220 | tail -4; }
done
[ -f "$WORK/bench_checks.log" ] && { echo "== bench_checks"; grep -E "^\||^- |^[a-z0-9-]+ / " "$WORK/bench_checks.log"; }
[ -f "$WORK/bench_fingerprint.log" ] && { echo "== bench_fingerprint"; grep -E "^\||^- |^[a-z0-9-]+ / |Error" "$WORK/bench_fingerprint.log"; }
[ -f "$WORK/peer_replay_gpu.log" ] && { echo "== peer_replay_gpu"; grep -E "replay under|^FAILED|^ERROR|passed|failed|Error" "$WORK/peer_replay_gpu.log" | cut -c1-300; }
[ -f "$WORK/bench_speculative.log" ] && { echo "== bench_speculative"; grep -E "^\||^- |^round" "$WORK/bench_speculative.log"; }
for f in "$WORK"/bench_graphs*.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "^\||^- " "$f"; }
done
[ -f "$WORK/bench_cross_entropy.log" ] && { echo "== bench_cross_entropy"; grep -E "^\||^\{" "$WORK/bench_cross_entropy.log"; }
for f in "$WORK"/kernel_floor.log "$WORK"/kernel_floor_gpt2.log "$WORK"/kernel_floor_small_tiny.log \
  "$WORK"/kernel_floor_probe.log; do
  [ -f "$f" ] && { echo "== $f"; grep -E "^\||^- |^kernel floor|^device idle|^[a-z0-9-]+ \(base|^trainer|^\{\"preset" "$f" | cut -c1-400; }
done
[ -f "$WORK/kernel_floor_tests.log" ] && grep -E "^FAILED|^ERROR|passed|failed" "$WORK/kernel_floor_tests.log" | tail -6
[ -f "$WORK/gpu_tests.log" ] && grep -E "^FAILED|^ERROR|passed|failed|SKIPPED|eager|graph" "$WORK/gpu_tests.log" | tail -16
cat "$WORK/summary.txt"
if [ "${#FAILED[@]}" -gt 0 ]; then  # loudly: the last lines of the call, and a non-zero exit
  printf '== FAILED step: %s\n' "${FAILED[@]}" | tee -a "$WORK/summary.txt" >&2
  tar czf "$OUT/gpu_check.tgz" -C "$WORK" .
  exit 1
fi
echo "== all steps passed"
