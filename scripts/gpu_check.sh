#!/usr/bin/env bash
# Runs the GPU checks of hypic on the H200 machine (never in CI). Needs the fla wheels in .whl/
# (../shared/tools/gpu-wheels.sh) carried with the call. Each section has its own time limit, and a
# failing section does not stop the next; details land in $OUT, the tables print last.
# Sections, in order:
#   GPU_TRAIN_PROFILE=1  one training step timed and profiled (scripts/gpu_train_profile.py)
#   GPU_OPS=1 (default)  kernels and composition (scripts/gpu_check.py; extra args pass through)
#   GPU_MODELS=1         whole models: 9B / 35B-A3B shapes vs transformers (GPU_MODELS_ARGS)
#   GPU_TTFT=1           TTFT across the ladder on the 9B shape (hypic bench ttft; GPU_TTFT_ARGS)
#   GPU_TRACE=1          a RAG trace served in real time on the 9B shape: TTFT under load and the
#                        sustainable rate per mode (hypic bench trace; GPU_TRACE_ARGS)
#   GPU_QUALITY=1        the full quality run of the bundled model (or GPU_QUALITY_MODEL) into
#                        $OUT/quality.{md,png,json}, rewritten after every label (GPU_QUALITY_ARGS)
#   GPU_SCATTER=1        cold TTFT with documents scattered over every GPU of the machine
#                        (hypic bench scatter on the 9B shape; GPU_SCATTER_ARGS)
#   GPU_DEVIATION=1      per-layer deviation from full, fp32, into $OUT/deviation.md (GPU_DEVIATION_ARGS)
#   GPU_GRAPH_AB=1       decode steps as CUDA graphs vs eager, in serving, inside one process
#                        (scripts/graph_ab.py; GPU_GRAPH_AB_ARGS)
#   GPU_FP8=1            bf16 against 8-bit weights (--quantization fp8): memory, logits, TTFT, decode steps,
#                        on the 35B-A3B shape both ways and the 80B-A3B shape in 8 bits (scripts/fp8_weights.py)
#   GPU_FIRST=1          a fresh process's first requests with the warm-up off and on, each with an empty
#                        Triton cache (scripts/first_requests.py; GPU_FIRST_ARGS, e.g. --model for the bundled one)
#   GPU_CUDNN=1          `full` prompts of new and met lengths ≥ 8 192 tokens: flash, cuDNN on exact lengths, cuDNN on
#                        bucketed lengths, one process each (scripts/cudnn_shapes.py; GPU_CUDNN_ARGS)
#   GPU_ECHO=1           echo scoring one prompt a forward vs packed, and lm-eval's max_tokens 1 request with a
#                        prefill for its token vs the token drawn from the scoring (scripts/echo_scoring.py; GPU_ECHO_ARGS)
#   GPU_DECODE_ATTN=1    decode attention candidates side by side (scripts/decode_attention.py)
#   GPU_STORE_MOVES=1    tier moves, churn and save/load of 9B-shape entries (scripts/store_moves.py)
#   GPU_WARM_PROFILE=1   calls of fully cached trace prompts timed per size, one profiled (trace_costs.py --warm-profile)
#   GPU_COMBINE_BENCH=1  the fused GDN combine's launch shapes and dot precisions (gdn_combine_bench.py;
#                        GPU_COMBINE_BENCH_ARGS, default: every precision at the default shape)
#   GPU_AGREEMENT=1      the combine pass's GPU paths' logits vs the general path, fp32 and bf16 (combine_agreement.py)
#   GPU_COLD_AB=1        the cold prefill alone with cold graphs on and off (HYPIC_COLD_GRAPHS=1|0),
#                        alternating processes twice (trace_costs.py --cold-alone); GPU_COLD_AB_VAR picks
#                        another switch (e.g. HYPIC_FUSED_COMBINE: the seams' pass A/B)
#   GPU_HOST_AB=1        the 1 024-document trace (hypic) with the host tier's summaries in each of
#                        GPU_HOST_AB_DTYPES (default "float32 bfloat16"), one process each, back to back
#   GPU_TRACE_AB=1       the 1 024-document trace (hypic, the default bf16 host tier) with a switch
#                        (GPU_TRACE_AB_VAR, default HYPIC_COLD_GRAPHS) at each of GPU_TRACE_AB_VALUES (default
#                        "1 0 1 0": alternating), GPU_TRACE_AB_RATES (default 16,24,32,48), GPU_TRACE_AB_SECONDS
#                        each (default 140); after a short unmeasured trace that compiles the Triton kernels
#                        (GPU_TRACE_AB_PRIME=0 skips it); GPU_TRACE_AB_ENV="NAME=VALUE ..." holds for every arm
#   GPU_BUDGET_AB=1      the same trace (cold graphs off) at each device budget of GPU_BUDGET_AB_VALUES (GiB or
#                        auto; default "74 auto 74"), GPU_BUDGET_AB_RATES (default 24,32), one process each
#   GPU_LOOP_PROFILE=1   the same trace at GPU_LOOP_PROFILE_RATES (default 32) with the serving loop's thread
#                        under cProfile (bench trace --profile): where the host time of a block goes
#   GPU_ARENA_EXIT=1     six processes that exit while the host tier's thread pins a slab (scripts/arena_exit.py)
#   SKIP_GPU_TESTS=1     skips the GPU-marked pytest tests (run last; GPU_TESTS_PATHS picks files, default all;
#                        HYPIC_TEST_SHARD=k/n runs the k-th of n shards of the files). GPU_TESTS_WORKERS
#                        (default 4) test processes share the GPU, a file each at a time (pytest-xdist,
#                        installed there): one process took > 570 s for the whole suite on 2026-12-04,
#                        more than a call leaves; most tests wait on the host (launches, compiles), not the GPU
set -u
OUT=${OUT:-$(mktemp -d)}
site=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1 FLA_DISABLE_BACKEND_DISPATCH=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule

section() {  # section NAME SECONDS command...: stdout+stderr into $OUT/NAME.log
  local name=$1 secs=$2; shift 2
  local t0=$SECONDS
  timeout "$secs" "$@" > "$OUT/$name.log" 2>&1
  echo "[$name] exit $? after $((SECONDS - t0)) s"
}

[ "${GPU_TRAIN_PROFILE:-0}" = 1 ] && section train_profile "${GPU_TRAIN_PROFILE_SECONDS:-100}" \
  python3 scripts/gpu_train_profile.py --out "$OUT" ${GPU_TRAIN_PROFILE_ARGS:-}
[ "${GPU_OPS:-1}" = 1 ] && section ops "${GPU_OPS_SECONDS:-330}" python3 scripts/gpu_check.py --out "$OUT" "$@"
[ "${GPU_MODELS:-0}" = 1 ] && section models "${GPU_MODELS_SECONDS:-300}" \
  python3 scripts/gpu_models.py --out "$OUT" ${GPU_MODELS_ARGS:-}
[ "${GPU_TTFT:-0}" = 1 ] && section ttft "${GPU_TTFT_SECONDS:-200}" \
  python3 -m hypic.cli bench ttft --shape qwen3.5-9b --device cuda --out "$OUT/ttft.md" ${GPU_TTFT_ARGS:-}
[ "${GPU_FP8:-0}" = 1 ] && section fp8 "${GPU_FP8_SECONDS:-500}" \
  python3 scripts/fp8_weights.py --out "$OUT/fp8.md" ${GPU_FP8_ARGS:-}
[ "${GPU_FIRST:-0}" = 1 ] && section first "${GPU_FIRST_SECONDS:-400}" \
  python3 scripts/first_requests.py --device cuda ${GPU_FIRST_ARGS:-}
[ "${GPU_CUDNN:-0}" = 1 ] && section cudnn "${GPU_CUDNN_SECONDS:-300}" \
  python3 scripts/cudnn_shapes.py ${GPU_CUDNN_ARGS:-}
[ "${GPU_ECHO:-0}" = 1 ] && section echo "${GPU_ECHO_SECONDS:-300}" \
  python3 scripts/echo_scoring.py ${GPU_ECHO_ARGS:-}
[ "${GPU_SCATTER:-0}" = 1 ] && section scatter "${GPU_SCATTER_SECONDS:-300}" \
  python3 -m hypic.cli bench scatter --shape qwen3.5-9b --device cuda:0 \
  --workers $(( $(python3 -c 'import torch; print(torch.cuda.device_count())') - 1 )) \
  --out "$OUT/scatter.md" ${GPU_SCATTER_ARGS:-}
[ "${GPU_TRACE:-0}" = 1 ] && section trace "${GPU_TRACE_SECONDS:-540}" \
  python3 -m hypic.cli bench trace --shape qwen3.5-9b --device cuda --out "$OUT/trace.md" ${GPU_TRACE_ARGS:-}
[ "${GPU_QUALITY:-0}" = 1 ] && section quality "${GPU_QUALITY_SECONDS:-300}" \
  python3 -m hypic.cli eval quality ${GPU_QUALITY_MODEL:+--model "$GPU_QUALITY_MODEL"} --device cuda --batch 64 \
  --out "$OUT/quality.md" ${GPU_QUALITY_ARGS:-}
[ "${GPU_DEVIATION:-0}" = 1 ] && section deviation "${GPU_DEVIATION_SECONDS:-300}" \
  python3 -m hypic.cli eval deviation --device cuda --dtype float32 --n 200 --batch 200 \
  --out "$OUT/deviation.md" ${GPU_DEVIATION_ARGS:-}
[ "${GPU_GRAPH_AB:-0}" = 1 ] && section graph_ab "${GPU_GRAPH_AB_SECONDS:-400}" \
  python3 scripts/graph_ab.py ${GPU_GRAPH_AB_ARGS:-}
[ "${GPU_DECODE_ATTN:-0}" = 1 ] && section decode_attention "${GPU_DECODE_ATTN_SECONDS:-180}" \
  python3 scripts/decode_attention.py
[ "${GPU_STORE_MOVES:-0}" = 1 ] && section store_moves "${GPU_STORE_MOVES_SECONDS:-240}" \
  python3 scripts/store_moves.py
[ "${GPU_WARM_PROFILE:-0}" = 1 ] && section warm_profile "${GPU_WARM_PROFILE_SECONDS:-200}" \
  python3 scripts/trace_costs.py --warm-profile
[ "${GPU_COMBINE_BENCH:-0}" = 1 ] && section combine_bench "${GPU_COMBINE_BENCH_SECONDS:-120}" \
  python3 scripts/gdn_combine_bench.py ${GPU_COMBINE_BENCH_ARGS:---variants 32,2 --precisions tf32x3,bf16x3,bf16x6}
[ "${GPU_AGREEMENT:-0}" = 1 ] && section agreement "${GPU_AGREEMENT_SECONDS:-240}" python3 scripts/combine_agreement.py
if [ "${GPU_COLD_AB:-0}" = 1 ]; then
  var=${GPU_COLD_AB_VAR:-HYPIC_COLD_GRAPHS}
  for arm in 1 0 1 0; do
    export "$var=$arm"
    section "cold_ab$arm" "${GPU_COLD_AB_SECONDS:-150}" python3 scripts/trace_costs.py --cold-alone
    unset "$var"
    grep -E '^cold (prefill alone|graphs)' "$OUT/cold_ab$arm.log" | sed "s/^/$var=$arm: /" >> "$OUT/cold_ab.txt"
  done
fi
if [ "${GPU_HOST_AB:-0}" = 1 ]; then
  for dt in ${GPU_HOST_AB_DTYPES:-float32 bfloat16}; do
    section "trace_host_$dt" "${GPU_HOST_AB_SECONDS:-280}" python3 -m hypic.cli bench trace --shape qwen3.5-9b \
      --device cuda --modes hypic --pool 1024 --requests 200 --warm 400 --rates "${GPU_HOST_AB_RATES:-16,24,32,48}" \
      --cache-host-dtype "$dt" --out "$OUT/trace_host_$dt.md"
  done
fi
TRACE1024="python3 -m hypic.cli bench trace --shape qwen3.5-9b --device cuda --modes hypic --pool 1024 --requests 200 --warm 400"
if [ "${GPU_TRACE_AB:-0}" = 1 ]; then
  # a short unmeasured trace first: a fresh machine's first process compiles the Triton kernels (a
  # warm-up of 74 s at ≈ 10% GPU utilization against 28 s, session 20), which no arm may pay
  [ "${GPU_TRACE_AB_PRIME:-1}" = 1 ] && section trace_ab_prime 150 python3 -m hypic.cli bench trace \
    --shape qwen3.5-9b --device cuda --modes hypic --pool 256 --requests 40 --warm 80 --rates 16 \
    --out "$OUT/trace_ab_prime.md"
  var=${GPU_TRACE_AB_VAR:-HYPIC_COLD_GRAPHS} k=0
  for v in ${GPU_TRACE_AB_VALUES:-1 0 1 0}; do
    k=$((k + 1)) name="trace_ab_${k}_${var}_${v//[^A-Za-z0-9_.-]/_}"  # a file name that comes back (no ':')
    section "$name" "${GPU_TRACE_AB_SECONDS:-140}" env ${GPU_TRACE_AB_ENV:-} "$var=$v" $TRACE1024 \
      --rates "${GPU_TRACE_AB_RATES:-16,24,32,48}" --out "$OUT/$name.md"
  done
fi
if [ "${GPU_BUDGET_AB:-0}" = 1 ]; then
  k=0
  for b in ${GPU_BUDGET_AB_VALUES:-74 auto 74}; do
    k=$((k + 1)) extra=""
    [ "$b" != auto ] && extra="--cache-gib $b"
    section "budget_ab_${k}_$b" "${GPU_BUDGET_AB_SECONDS:-150}" env HYPIC_COLD_GRAPHS=0 $TRACE1024 $extra \
      --rates "${GPU_BUDGET_AB_RATES:-24,32}" --out "$OUT/budget_ab_${k}_$b.md"
  done
fi
[ "${GPU_LOOP_PROFILE:-0}" = 1 ] && section loop_profile "${GPU_LOOP_PROFILE_SECONDS:-200}" $TRACE1024 \
  --rates "${GPU_LOOP_PROFILE_RATES:-32}" --profile "$OUT/loop.prof" --out "$OUT/loop_profile.md"
if [ "${GPU_ARENA_EXIT:-0}" = 1 ]; then  # exits while the host tier pins: every run must be rc 0
  for k in 1 2 3 4 5 6; do
    python3 scripts/arena_exit.py --delay-s "0.0$k" > "$OUT/arena_exit_$k.log" 2>&1
    echo "arena_exit run $k (delay 0.0$k s): rc $? $(grep -h 'alive at exit' "$OUT/arena_exit_$k.log")" >> "$OUT/arena_exit.txt"
  done
fi
xdist="" workers=${GPU_TESTS_WORKERS:-4}
[ "$workers" -gt 1 ] && python3 -c 'import xdist' 2>/dev/null && xdist="-n $workers --dist loadfile"
[ "${SKIP_GPU_TESTS:-0}" != 1 ] && section pytest_gpu "${GPU_TESTS_SECONDS:-420}" \
  python3 -m pytest -q -m gpu ${GPU_TESTS_PATHS:-tests --ignore=tests/server} $xdist -p no:cacheprovider --durations=12

# the tables last
[ -f "$OUT/train_profile.log" ] && grep -E '^(data|step|kernel)' "$OUT/train_profile.log"
[ -f "$OUT/pytest_gpu.log" ] && tail -n 16 "$OUT/pytest_gpu.log"
for f in ops models ttft fp8 first cudnn echo scatter trace graph_ab decode_attention combine_bench agreement; do
  [ -f "$OUT/$f.log" ] && grep -E '^\||FAILED|Error|^\{|failed \(rc|^warm-up (on|off):|warm /|^ttft |^scatter |^trace |^(uniform|skewed):' "$OUT/$f.log" | tail -n 60
done
[ -f "$OUT/warm_profile.log" ] && grep -E '^\||^profiled|time total' "$OUT/warm_profile.log" | head -n 14
[ -f "$OUT/store_moves.log" ] && grep -E '^\||^(persist|churn|40 )' "$OUT/store_moves.log"
[ -f "$OUT/cold_ab.txt" ] && cat "$OUT/cold_ab.txt"
[ -f "$OUT/arena_exit.txt" ] && cat "$OUT/arena_exit.txt"
for f in "$OUT"/trace_host_*.log "$OUT"/trace_ab_*.log "$OUT"/budget_ab_*.log; do [ -f "$f" ] && grep -E '^trace |^\| hypic' "$f" | sed "s|^|$(basename "$f" .log): |"; done
[ -f "$OUT/loop_profile.log" ] && grep -E -A 40 "^the serving loop's profile" "$OUT/loop_profile.log" | head -n 45
[ -f "$OUT/quality.md" ] && grep -E '^\|' "$OUT/quality.md"
[ -f "$OUT/quality.log" ] && grep -E 'Error' "$OUT/quality.log" | tail -n 5
[ -f "$OUT/deviation.md" ] && grep -E '^\|' "$OUT/deviation.md"
[ -f "$OUT/deviation.log" ] && grep -E 'Error' "$OUT/deviation.log" | tail -n 5
exit 0
