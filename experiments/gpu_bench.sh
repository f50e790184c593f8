#!/usr/bin/env bash
# The benchmark figures of experiments/README.md's GPU section, in one call on a lent GPU machine
# (it has jax, flax, optax, orbax and h5py; the repo runs from its root with PYTHONPATH=.):
#   bash experiments/gpu_bench.sh [OUT_DIR]
set -uo pipefail
out=${1:-${OUT:-/tmp}}
export PYTHONPATH=. PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$out/gpu.txt"
python -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/gpu.txt"
timeout 200 python experiments/bench_train.py --shape original --batch 128 --steps 5 2>&1 | tee "$out/bench_train_original.txt"
timeout 120 python experiments/bench_train.py --shape small --batch 128 --steps 5 --vocabs 793471 2>&1 | tee "$out/bench_train_small.txt"
timeout 200 python experiments/bench_embed.py --shapes original small --repeats 3 2>&1 | tee "$out/bench_embed.txt"
