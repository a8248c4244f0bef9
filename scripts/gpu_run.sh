#!/usr/bin/env bash
# One device call: build kbench on the GPU machine, run the GPU tests and the benchmark, and leave
# logs and results under $OUT. Phases: PHASES="build tests bench probe" (default: all but probe);
# BENCH_ARGS, TESTS (paths), TESTS_K (a pytest -k expression); PROBE: commands for the probe
# phase (e.g. "python3 benchmarks/bench_genomes.py layer_norm --dtype bfloat16"), run last,
# output in probe.log.
# KBENCH_COMMIT=<hash>: give it literally (from this machine's git): the GPU machine's copy of
# .git is stale, so $(git rev-parse HEAD) evaluated there names an older commit.
set -uo pipefail
OUT=${OUT:-/tmp/kbench-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 KBENCH_CACHE_DIR=${KBENCH_CACHE_DIR:-/tmp/kbench-cache}
PHASES=${PHASES:-build tests bench}
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/gpu.txt"
status=0
if [[ $PHASES == *build* ]]; then
    python3 -m pip install --no-build-isolation --no-deps -e . -q > "$OUT/build.log" 2>&1 || { tail -40 "$OUT/build.log"; exit 1; }
    python3 -m kbench info | tee "$OUT/info.txt"
fi
if [[ $PHASES == *tests* ]]; then
    timeout ${TEST_TIMEOUT:-300} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout 120 -rfE \
        ${TESTS_K:+-k "$TESTS_K"} ${TESTS:-tests/gpu} > "$OUT/gpu_tests.log" 2>&1 || status=1
    grep -E "passed|failed|error" "$OUT/gpu_tests.log" | tail -3
    grep -E "^(FAILED|ERROR)" "$OUT/gpu_tests.log" | head -40
fi
if [[ $PHASES == *bench* ]]; then
    timeout ${BENCH_TIMEOUT:-300} python3 benchmarks/bench_ops.py --out "$OUT" ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 || status=1
    tail -45 "$OUT/bench.log"
fi
if [[ $PHASES == *probe* ]]; then
    timeout ${PROBE_TIMEOUT:-300} bash -c "$PROBE" > "$OUT/probe.log" 2>&1 || status=1
    tail -${PROBE_TAIL:-60} "$OUT/probe.log"
fi
exit $status
