# Session 19's device commands, kept as the record behind benchmarks/NOTES.md session 19 (run through
# scripts/gpu_run.sh: PHASES="build probe" PROBE="PART=n bash scripts/probe_s19.sh"): 1 the GPT-2 fast tune and
# the softmax repeat probe, 2 more repeat probes and test_search_fast, 3 the GPT-2 tune's cache export,
# 4 genome sweeps of short rows with column sums, 5 the tune and bias+GELU after the new default, 6 checks.
set -u
if [[ ${PART:-1} == 1 ]]; then
  echo "=== bench_tune"; timeout 200 python3 benchmarks/bench_tune.py --out "$OUT" 2>&1 | tail -40
  for i in 1 2; do echo "=== softmax f32 process $i"; timeout 120 python3 benchmarks/search_repeat_probe.py --model softmax --dtype float32 --repeats 4 2>&1 | grep -v "by rounds"; done
elif [[ ${PART} == 2 ]]; then
  for i in 3 4 5; do echo "=== softmax f32 process $i"; timeout 120 python3 benchmarks/search_repeat_probe.py --model softmax --dtype float32 --repeats 4 2>&1 | grep -v "by rounds"; done
  for i in 1 2 3; do echo "=== layernorm bf16 process $i"; timeout 120 python3 benchmarks/search_repeat_probe.py --model layernorm --dtype bfloat16 --repeats 4 2>&1 | grep -v "by rounds"; done
  for i in 1 2; do echo "=== test_search_fast $i"; timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider tests/gpu/test_search.py -k search_fast 2>&1 | tail -4; done
fi
if [[ ${PART:-1} == 3 ]]; then
  # GPT-2-sized model, fast budget, into a cache we export: every candidate's genome and time per region
  mkdir -p "$OUT/tunecache"
  KBENCH_CACHE_DIR="$OUT/tunecache" timeout 150 python3 benchmarks/bench_tune.py --child --blocks 2 2>&1 | tail -c 600
  KBENCH_CACHE_DIR="$OUT/tunecache" python3 -m kbench cache export --no-cubins "$OUT/tune.jsonl"; rm -rf "$OUT/tunecache"
  echo "=== log_softmax bf16 row"; timeout 200 python3 benchmarks/bench_ops.py --tasks log_softmax,layer_norm --dtypes bfloat16 --backward --reps 50 --out "$OUT" 2>&1 | tail -12
fi
if [[ ${PART:-1} == 4 ]]; then
  # short rows with column sums (a LayerNorm backward at GPT-2's 768): block-per-row variants
  V=()
  for p in 0 1; do for tv in "128 4" "256 4" "256 2" "512 2" "512 1" "1024 1" "128 8" "256 8"; do set -- $tv
    V+=(--genome "threads=$1 vec=$2 rows=1 items=1 cache=regs persistent=$p"); done; done
  V+=(--genome "threads=1024 vec=1 rows=2 items=4 cache=reread persistent=1" --genome "threads=512 vec=2 rows=2 items=1 cache=regs persistent=1")
  for spec in "layer_norm float32 2048,768" "layer_norm bfloat16 2048,768" "layer_norm float32 16384,768" \
              "rms_norm float32 2048,768" "residual_layer_norm float32 2048,768" "layer_norm bfloat16 8192,1024"; do
    set -- $spec; echo "=== $spec"
    timeout 90 python3 benchmarks/bench_genomes.py $1 --dtype $2 --shape $3 --no-forward --no-sweep "${V[@]}" 2>&1 | grep -v "refused" | cut -c1-200
  done
fi
if [[ ${PART:-1} == 5 ]]; then
  echo "=== bench_tune"; timeout 150 python3 benchmarks/bench_tune.py --out "$OUT" 2>&1 | tail -25
  for dt in "float32 4" "bfloat16 8"; do set -- $dt; echo "=== bias_gelu_tanh $1 2048,768 (single-pass column sum)"
    timeout 60 python3 benchmarks/bench_genomes.py bias_gelu_tanh --dtype $1 --shape 2048,768 --no-forward --no-sweep \
      --genome "threads=256 vec=$2 rows=8 items=4 cache=reread persistent=1" --genome "threads=256 vec=2 rows=1 items=1 cache=regs persistent=1" \
      --genome "threads=512 vec=2 rows=1 items=1 cache=regs persistent=1" --genome "threads=1024 vec=4 rows=1 items=1 cache=regs persistent=1" 2>&1 | grep -v refused | cut -c1-200
  done
fi
if [[ ${PART:-1} == 6 ]]; then
  for i in 1 2 3; do echo "=== tests/gpu/test_search.py $i"; timeout 150 python3 -m pytest -m gpu -q -p no:cacheprovider -rfE tests/gpu/test_search.py 2>&1 | tail -4; done
  echo "=== module_load_probe"; timeout 120 python3 benchmarks/module_load_probe.py --loads 3 --rounds 200 2>&1 | tail -16
fi
