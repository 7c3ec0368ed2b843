#!/usr/bin/env bash
# GPU check for stalwart.graphs: GPU tests, then the benchmark, logs and JSON into $OUT.
# Usage (device machine, repo root): OUT=/some/dir bash scripts/gpu_graphs_check.sh
# TOTAL_BUDGET_S bounds the whole run; the benchmark gets what the tests left.
set -uo pipefail
OUT="${OUT:-runs/gpu_graphs}"
mkdir -p "$OUT"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
TOTAL_BUDGET_S="${TOTAL_BUDGET_S:-500}"
start=$(date +%s)
{
  echo "== env"; python3 -c "import torch; print(torch.__version__, torch.version.cuda, torch.cuda.get_device_name())"
  nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm --format=csv 2>/dev/null || true
} 2>&1 | tee "$OUT/env.log"

echo "== gpu tests"
timeout 240 python3 -m pytest -q -m gpu -rA -s tests/gpu/test_graphs*.py -p no:cacheprovider \
  --junitxml="$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log"
tests_rc=${PIPESTATUS[0]}

left=$(( TOTAL_BUDGET_S - ($(date +%s) - start) - 30 ))
echo "== bench (budget ${left}s)"
timeout $(( left + 20 )) python3 bench/graphs.py --budget-s "$left" --json "$OUT/bench_graphs.json" ${BENCH_ARGS:-} \
  2>&1 | tee "$OUT/bench_graphs.log"
bench_rc=${PIPESTATUS[0]}
echo "tests_rc=$tests_rc bench_rc=$bench_rc elapsed=$(( $(date +%s) - start ))s" | tee "$OUT/summary.txt"
exit $(( tests_rc != 0 || bench_rc != 0 ))
