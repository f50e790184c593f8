#!/usr/bin/env bash
# Every GPU figure of experiments/README.md on a lent GPU machine (it has jax, flax, optax, orbax
# and h5py; the repo runs from its root with PYTHONPATH=.), each part under a timeout:
#   bash benchmarks/gpu_bench.sh [OUT_DIR]
# The default is issue 30's one measurement, under 8 minutes in all (REHEARSE=1: tiny shapes on a
# CPU, about 5 minutes; BUDGET=seconds to change the 465 s; BASELINE=DIR adds the previous
# commit's step if time is left):
#   measure   gpu_measure.py: the roofline (nvidia-smi clocks, 8192^3 bfloat16 and tf32 matmuls by
#             the slope of dependent matmuls in one fori_loop), the `original` step in bfloat16 at
#             128 and 384 rows (tokens/s, MFU against the datasheet peak and the measured matmul,
#             peak memory), `elmo-jax train` at 384 rows, a >=100,000-token extraction job in
#             bfloat16, the 128-row step by autodiff of the LSTM scan (the custom VJP's gain), a per-part
#             profile of the 128-row step: roofline.txt, step128.txt, step384.txt, cli.txt, extract.txt,
#             autodiff128.txt, profile.txt, summary.txt
# PARTS picks other parts, run in this order (e.g. projection embed cli profile, about 9 minutes
# with BASELINE: two calls, PARTS="projection embed" then PARTS="cli profile"):
#   projection  gpu_projection.py: the cost model's projection of the embed and cli parts, with the
#             host's shares measured on this machine's CPU (about 20 s), to set beside them
#   embed     a whole extraction job, `original` shape, on experiments/data/lm/heldout.txt (or the
#             bundled sample), bfloat16 and float32, cold (compiles included) and warm; with
#             BASELINE=DIR (the previous commit's tree, from git archive) that tree's float32;
#             then bfloat16 under each EMBED_SWEEP setting (bench_embed.py's --job-steps,
#             --job-tokens and --job-layers: the layout's extraction steps and rows per call, and
#             every layer against the top one mixed on the device); then pooled (pool=mean, on
#             the device), every layer and the top one
#   embed-cli `elmo-jax embed` itself on the same file, a fresh process each (startup and compiles
#             included), writing every line's layers, with --ahead 0 and 1 (bench_embed_cli.py)
#   variants  the roofline (harness.roofline_report), then the train step, `original` shape, 128 x 20,
#             with MFU against the datasheet peak and the measured matmul, under each precision x layout in
#             VARIANTS: "f32" is what every GPU ran before elmo_jax.model.layout (the previous commit's
#             float32 step), "gpu" the library's GPU default now (bfloat16 policy, GPU layout)
#   xla-flags the default step ("gpu" variant) under each XLA_FLAGS set in FLAG_SETS (';'-separated;
#             default: none, the latency-hiding scheduler, command buffers that also take while
#             loops), a fresh process each: xla_flags.txt
#   batch-quality  experiments/batch_size.py: 1,000 steps at 384 rows against 3,000 at 128, bfloat16,
#             the experiments' config, held-out perplexity of both directions at the same tokens
#             (needs experiments/data/lm): batch_size/table.md
#   quality   1,000 steps of the experiments' config in bfloat16 and in float32, each scored on
#             held-out text (needs experiments/data/lm, carried)
#   cli       `elmo-jax train` itself, `original` shape, 128 rows, 300 steps: tokens/s with the
#             host pipeline in the loop, once per flag set in CLI_VARIANTS (';'-separated;
#             default: prefetch 0, prefetch 2, prefetch 2 with 2 candidate workers), and the
#             BASELINE tree's (needs experiments/data/lm); each with the number of train-step
#             programs the run needed (1 unless the step recompiled mid-run)
#   profile   a jax.profiler trace of the "gpu" step with XLA's command buffers off (so that each
#             kernel is its own event): profile_top.txt, device time per part of the step (each
#             kernel's HLO instruction looked up in the compiled module's name stacks)
# SHAPE/BATCH shrink the shapes for a CPU rehearsal. Both inputs are ignored by git: make them with
#   git archive --prefix=.baseline/ <previous commit> | tar -x
#   bash experiments/fetch_data.sh && python experiments/prep_corpus.py
# and carry ".baseline" and "experiments/data/lm" (3 + 11 MB) to the device machine.
set -uo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment above, as usage
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
out=${1:-${OUT:-/tmp}}
parts=${PARTS:-measure}
shape=${SHAPE:-original}
batch=${BATCH:-128}
export PYTHONPATH=. PYTHONUNBUFFERED=1
mkdir -p "$out"
(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true) | tee "$out/gpu.txt"
python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
has() { [[ " $parts " == *" $1 "* ]]; }
lm=experiments/data/lm
if has measure; then
  measure=(--out "$out" --budget "${BUDGET:-465}")
  [ -n "${REHEARSE:-}" ] && measure+=(--rehearse)
  [ -n "${BASELINE:-}" ] && measure+=(--baseline "$BASELINE")
  python benchmarks/gpu_measure.py "${measure[@]}" 2>&1
fi
if has projection; then
  timeout "${PROJECTION_S:-90}" python benchmarks/gpu_projection.py 2>&1 | tee "$out/projection.txt"
fi
if has embed; then
  job=(); [ -f $lm/heldout.txt ] && job=(--job-file $lm/heldout.txt)
  timeout "${EMBED_S:-240}" python benchmarks/bench_embed.py --shapes "$shape" --job-only "${job[@]}" \
    --job-precisions bfloat16 float32 2>&1 | tee "$out/embed.txt"
  if [ -n "${BASELINE:-}" ]; then  # the previous commit's float32, the figure extraction must not fall below
    PYTHONPATH="$BASELINE" timeout "${EMBED_BASELINE_S:-150}" python benchmarks/bench_embed.py --shapes "$shape" \
      --job-only "${job[@]}" --job-precisions float32 2>&1 | sed 's/^/baseline: /' | tee -a "$out/embed.txt"
  fi
  # shellcheck disable=SC2086  # the options are words
  timeout "${EMBED_SWEEP_S:-120}" python benchmarks/bench_embed.py --shapes "$shape" --job-only "${job[@]}" \
    --job-precisions bfloat16 ${EMBED_SWEEP:---job-steps 20 80 --job-layers all top} 2>&1 | tee "$out/embed_sweep.txt"
  # Pooled on the device: the host receives a sum per sentence piece, not every token's vectors.
  timeout "${EMBED_POOL_S:-60}" python benchmarks/bench_embed.py --shapes "$shape" --job-only "${job[@]}" \
    --job-precisions bfloat16 --job-layers all top --job-pool mean 2>&1 | tee "$out/embed_pool.txt"
fi
if has embed-cli; then  # not in the default parts: `elmo-jax embed` end to end, --ahead 0 against 1
  timeout "${EMBED_CLI_S:-150}" python benchmarks/bench_embed_cli.py --shape "$shape" --rounds 1 \
    2>&1 | tee "$out/embed_cli.txt"
fi
if has variants; then
  timeout "${VARIANTS_S:-150}" python benchmarks/bench_variants.py --shape "$shape" --batch "$batch" --steps 5 \
    --variants ${VARIANTS:-f32 gpu gpu-f32} 2>&1 | tee "$out/variants.txt"
fi
if has xla-flags; then
  IFS=';' read -ra sets <<< "${FLAG_SETS:- ;--xla_gpu_enable_latency_hiding_scheduler=true;--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL}"
  : > "$out/xla_flags.txt"
  for flags in "${sets[@]}"; do
    echo "XLA_FLAGS+=[$flags]" | tee -a "$out/xla_flags.txt"
    all=$(echo "${XLA_FLAGS:-} $flags" | xargs)  # no flags at all must be unset: XLA reads "  " as a file name
    XLA_FLAGS="$all" timeout "${FLAGS_S:-60}" python benchmarks/bench_variants.py --shape "$shape" \
      --batch "$batch" --steps 5 --variants gpu --roofline-size 0 > /tmp/xla_flags.log 2>&1
    code=$?
    # The step's line, or (a flag XLA rejects, a timeout) the exit code and the log's last lines.
    grep -E '^gpu ' /tmp/xla_flags.log | tee -a "$out/xla_flags.txt" || { echo "exit $code"; tail -3 /tmp/xla_flags.log; } | tee -a "$out/xla_flags.txt"
  done
fi
if has batch-quality && [ -d $lm ]; then
  # shellcheck disable=SC2086  # the arms are words
  timeout "${BATCH_QUALITY_S:-360}" python experiments/batch_size.py --arms ${BATCH_ARMS:-128x3000 384x1000} \
    --evals "${BATCH_EVALS:-4}" --precision bfloat16 --out "$out/batch_size" --runs /tmp/batch_runs 2>&1 | tail -8
fi
if has quality && [ -d $lm ]; then
  for dtype in float32 bfloat16; do
    timeout "${QUALITY_S:-80}" python -m elmo_jax train --config $lm/options.json \
      --train-files "$lm/train/*.txt" --heldout-files $lm/heldout.txt --vocab $lm/vocab.txt \
      --run-dir "/tmp/quality_$dtype" --steps "${QUALITY_STEPS:-1000}" --precision "$dtype" --reset-state-prob 0.1 \
      --log-every "${QUALITY_LOG:-100}" --eval-every "${QUALITY_STEPS:-1000}" --save-every "${QUALITY_STEPS:-1000}" \
      --no-progress > "/tmp/quality_$dtype.log" 2>&1
    echo "quality $dtype: exit $?" | tee -a "$out/quality.txt"
    grep -h '"heldout' "/tmp/quality_$dtype/metrics.jsonl" | sed "s/^/$dtype /" | tee -a "$out/quality.txt"
  done
fi
if has cli && [ -d $lm ]; then
  # One compile cache for the runs: each run's start-up then loads the step instead of compiling it.
  IFS=';' read -ra variants <<< "${CLI_VARIANTS:---prefetch 0;--prefetch 2;--prefetch 2 --host-workers 2}"
  runs=("${variants[@]}"); [ -n "${BASELINE:-}" ] && runs+=("baseline")
  : > "$out/cli.txt"
  for flags in "${runs[@]}"; do
    tree=.; extra=$flags; [ "$flags" = baseline ] && tree=$BASELINE && extra=""
    rm -rf /tmp/cli_run
    # shellcheck disable=SC2086  # the flags are words
    # JAX_LOG_COMPILES: each program the step needs is logged, from the cache or compiled.
    PYTHONPATH="$tree" JAX_LOG_COMPILES=1 timeout "${CLI_S:-75}" python -m elmo_jax --compile-cache /tmp/xla_cli \
      train --config "$shape" --batch-size "$batch" --train-files "$lm/train/*.txt" --vocab $lm/vocab.txt \
      --run-dir /tmp/cli_run --steps "${CLI_STEPS:-300}" --log-every 50 --save-every 100000 --no-progress $extra \
      > /tmp/cli.log 2>&1
    echo "cli train [$flags]: exit $?" | tee -a "$out/cli.txt"
    grep -m1 -E '^(starting|resuming)' /tmp/cli.log | tee -a "$out/cli.txt"
    echo "train-step programs: $(grep -c 'Compiling jit(per_device)' /tmp/cli.log)" | tee -a "$out/cli.txt"
    python -c "import json,sys; [print(l['step'], round(l['tokens_per_s']), l.get('startup_s', '')) for l in map(json.loads, open(sys.argv[1]))]" \
      /tmp/cli_run/metrics.jsonl 2>&1 | tee -a "$out/cli.txt"
  done
fi
if has profile; then
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" timeout "${PROFILE_S:-70}" \
    python benchmarks/bench_variants.py --shape "$shape" --batch "$batch" --steps 3 --variants "${PROFILE:-gpu}" \
    --profile "${PROFILE:-gpu}" --profile-out "$out" 2>&1 | tail -40
fi
