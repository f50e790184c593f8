#!/usr/bin/env bash
# The pretraining run of experiments/README.md on a lent GPU machine, in one call: the same
# `elmo-jax train` command as on the CPU, then both held-out evaluations and the export.
#   bash experiments/gpu_pretrain.sh OUT_DIR     (needs experiments/data/lm from prep_corpus.py)
# TRAIN_ARGS adds flags to the train command (e.g. TRAIN_ARGS='--reset-state-prob 0', bilm-tf's recipe).
# TRAIN_SECONDS bounds the training; on SIGTERM `elmo-jax train` saves its checkpoint and stops.
set -uo pipefail
if [[ "${1:-}" == -h || "${1:-}" == --help ]]; then  # the comment above, as usage
  sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0
fi
out=${1:?usage: gpu_pretrain.sh OUT_DIR}
run=${RUN_DIR:-/tmp/real}
export PYTHONPATH=. PYTHONUNBUFFERED=1
# At most 8 files come back from the device machine: log.txt, evals.jsonl, metrics.jsonl,
# options.json and the 4 exported files.
nvidia-smi --query-gpu=name --format=csv,noheader > "$out/log.txt"
start=$(date +%s)
timeout -s TERM "${TRAIN_SECONDS:-360}" python -m elmo_jax train --config experiments/data/lm/options.json \
  --train-files 'experiments/data/lm/train/*.txt' --heldout-files experiments/data/lm/heldout.txt \
  --vocab experiments/data/lm/vocab.txt --run-dir "$run" --eval-every 700 --save-every 1000 --log-every 50 \
  --no-progress ${TRAIN_ARGS:-} >> "$out/log.txt" 2>&1
code=$?
echo "train exit $code after $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"
# 124: stopped by the timeout's SIGTERM, its checkpoint saved. Anything else: nothing to evaluate.
if [[ $code != 0 && $code != 124 ]]; then
  tail -3 "$out/log.txt"; echo "gpu_pretrain.sh: the training failed (exit $code); $out/log.txt has its output"; exit 1
fi
cp "$run/metrics.jsonl" "$run/options.json" "$out/"
python -m elmo_jax eval --run-dir "$run" --files experiments/data/lm/heldout.txt > "$out/evals.jsonl"
python -m elmo_jax eval --run-dir "$run" --files experiments/data/lm/heldout.txt --reset-state-per-sentence \
  >> "$out/evals.jsonl"
python -m elmo_jax export --run-dir "$run" --out-dir "$out/export"
echo "all done after $(( $(date +%s) - start )) s" | tee -a "$out/log.txt"
tail -3 "$out/log.txt"; cat "$out/evals.jsonl"
