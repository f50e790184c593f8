#!/usr/bin/env bash
# Every GPU figure of experiments/README.md in one call on a lent GPU machine (it has jax, flax,
# optax, orbax and h5py; the repo runs from its root with PYTHONPATH=.), each part under a timeout:
#   bash experiments/gpu_bench.sh [OUT_DIR]
# PARTS picks parts (default all): variants (precision x layout, with a profile of the bf16
# default: profile_top.txt), quality (1,000 steps of the experiments' config in bfloat16 and in
# float32, each scored on held-out text; needs experiments/data/lm, carried), train, embed.
# BASELINE=DIR: the previous commit's tree (git archive), timed beside this one in the same call.
set -uo pipefail
out=${1:-${OUT:-/tmp}}
parts=${PARTS:-variants quality train embed}
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
has() { [[ " $parts " == *" $1 "* ]]; }
if has variants; then
  timeout "${VARIANTS_S:-240}" python experiments/bench_variants.py --shape "${SHAPE:-original}" --batch "${BATCH:-128}" --steps 5 \
    --variants ${VARIANTS:-f32 bf16 bf16-c0 bf16-c0-u5 tf32 bf16-c0-u20} --profile "${PROFILE:-bf16-c0}" \
    --profile-out "$out" 2>&1 | tee "$out/variants.txt"
fi
if has quality && [ -d experiments/data/lm ]; then
  for dtype in float32 bfloat16; do
    timeout "${QUALITY_S:-80}" python -m elmo_jax train --config experiments/data/lm/options.json \
      --train-files 'experiments/data/lm/train/*.txt' --heldout-files experiments/data/lm/heldout.txt \
      --vocab experiments/data/lm/vocab.txt --run-dir "/tmp/quality_$dtype" --steps "${QUALITY_STEPS:-1000}" \
      --dtype "$dtype" --reset-state-prob 0.1 --log-every "${QUALITY_LOG:-100}" --eval-every "${QUALITY_STEPS:-1000}" \
      --save-every "${QUALITY_STEPS:-1000}" --no-progress > "/tmp/quality_$dtype.log" 2>&1
    echo "quality $dtype: exit $?" | tee -a "$out/quality.txt"
    tail -2 "/tmp/quality_$dtype.log" | tee -a "$out/quality.txt"
    grep -h '"heldout' "/tmp/quality_$dtype/metrics.jsonl" | sed "s/^/$dtype /" | tee -a "$out/quality.txt"
  done
fi
if has train; then
  timeout "${TRAIN_S:-120}" python experiments/bench_train.py --shape original --batch 128 --steps 5 --vocabs 793471 \
    2>&1 | tee "$out/bench_train_original.txt"
  if [ -n "${BASELINE:-}" ]; then
    (cd "$BASELINE" && PYTHONPATH=. timeout "${TRAIN_S:-120}" python experiments/bench_train.py --shape original \
      --batch 128 --steps 5 --vocabs 793471) 2>&1 | sed 's/^/baseline: /' | tee -a "$out/bench_train_original.txt"
  fi
fi
if has embed; then
  timeout "${EMBED_S:-150}" python experiments/bench_embed.py --shapes original --repeats 3 2>&1 | tee "$out/bench_embed.txt"
fi
