"""A cost model for the GPU figures no session has measured yet: a whole extraction job, and the
training CLI with its host pipeline, on the H100 of ``results/gpu_h100/``. A projection, not a
measurement: ``gpu_bench.sh`` measures both when a GPU is lent.

    python benchmarks/gpu_projection.py [--job-file experiments/data/lm/heldout.txt]

Inputs, each printed with its source:

- the H100's training steps (``results/gpu_h100/call2_variants.txt``, ``call1_variants.txt``):
  time and executed FLOPs of the default step (bfloat16, GPU layout) and of float32 steps, so
  their achieved FLOP/s;
- the job's plan under the GPU layout (``elmo_jax.extract.packing.pack_sentences``) and its FLOPs:
  ``harness.lstm_flops`` per padded token-step, ``encoder_flops`` per distinct word;
- the host's share of the job, measured here and now with no device (``bench_embed.bench_host``);
- the training loop's host pipeline, measured here and now (``bench_train.bench_host_pipeline``).

The model:

- The job's device time, two ways. Likely: its FLOPs at the achieved rate of the training step
  of the same precision (the job's matmuls are 3x as many rows, so at least as efficient).
  Pessimistic: each of the plan's sequential steps costs as much as 1/20 of the training step,
  whose 20 steps also carry a backward pass, the char CNN, the softmax and the optimizer.
- Host and device overlap (the host copies each call's outputs while the device runs the next
  two), so a job takes the larger of the two, plus one call's device time that nothing overlaps.
- A training step takes the larger of the device step and the host's time per batch.

The host here is the 2-core development VM; a GPU host's cores and memory differ, and its first
write to new memory (a page fault per 4 KiB page here) may cost much less.
"""

from __future__ import annotations

import argparse
import os
import re
import tempfile

from bench_embed import bench_host, sample_sentences
from bench_train import bench_host_pipeline, zipf_corpus
from harness import encoder_flops, lstm_flops

from elmo_jax import preset
from elmo_jax.config import TrainConfig

HERE = os.path.dirname(os.path.abspath(__file__))
H100 = os.path.join(HERE, "results", "gpu_h100")
TARGET = 150_000  # tokens/s, issue 15's extraction target (bfloat16, one GPU, a whole job)


def measured_steps(path: str) -> tuple[str, dict[str, tuple[float, float]]]:
    """(device line, {variant: (ms a step, GFLOP a step)}) from a ``bench_variants.py`` output."""
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    device = next(line for line in lines if line.startswith("device:"))
    gflop = float(re.search(r"([\d,]+) GFLOP a step", "\n".join(lines)).group(1).replace(",", ""))
    steps = {}
    for line in lines:
        m = re.match(r"(\S+)\s+([\d.]+) ms/step", line)
        if m:
            steps[m.group(1)] = (float(m.group(2)), gflop)
    return device, steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    default_job = os.path.join(os.path.dirname(HERE), "experiments", "data", "lm", "heldout.txt")
    ap.add_argument(
        "--job-file",
        default=default_job if os.path.exists(default_job) else None,
        help="one tokenized sentence per line (default: the experiments' held-out text, else the bundled sample's)",
    )
    args = ap.parse_args()
    config = preset("original")

    device, steps = measured_steps(os.path.join(H100, "call2_variants.txt"))
    _, steps1 = measured_steps(os.path.join(H100, "call1_variants.txt"))
    print(f"measured (results/gpu_h100/call2_variants.txt): {device}")
    rates = {}  # precision -> (training step ms, achieved TFLOP/s)
    for precision, name in {"bfloat16": "gpu", "float32": "f32"}.items():
        ms, gflop = steps[name]
        rates[precision] = (ms, gflop / ms)  # GFLOP per ms = TFLOP/s
        print(
            f"  training step '{name}' ({precision}): {ms:.2f} ms, {gflop:,.0f} GFLOP -> "
            f"{rates[precision][1]:.1f} TFLOP/s achieved"
        )
    print(
        f"  (call1_variants.txt, the same card: 'f32' {steps1['f32'][0]:.2f} ms, the same step as 'gpu' "
        f"{steps1['bf16-c0-u20'][0]:.2f} ms; float32 under the GPU layout was not measured, so float32 "
        "below is the 'f32' step's rate, under the layout before: a low estimate)"
    )

    # -- extraction ------------------------------------------------------------------------
    sents = sample_sentences(args.job_file)
    tokens = sum(len(s) for s in sents)
    print(f"\nthe host's share of the job, measured on this machine ({os.cpu_count()} cores), no device:")
    pack, host = bench_host("original", config, args.job_file, "gpu")
    token_steps = pack.rows * pack.steps * pack.calls
    distinct = len({w for s in sents for w in s})
    flop = token_steps * lstm_flops(config) + distinct * encoder_flops(config)
    seq = pack.calls * pack.steps
    print(
        f"\nthe job: {tokens:,} tokens, {pack.calls} calls of {pack.rows} rows x {pack.steps} steps = {seq} "
        f"sequential steps, {token_steps:,} padded token-steps, {distinct:,} distinct words: "
        f"{flop / 1e12:.1f} TFLOP"
    )
    print("projected whole-job tokens/s on that H100 with this host, likely | pessimistic device time:")
    for precision, (ms, tflops) in rates.items():
        device_s = {"likely": flop / (tflops * 1e12), "pessimistic": seq * ms / 1e3 / 20}
        print(f"  {precision}: device {device_s['likely']:.2f} | {device_s['pessimistic']:.2f} s")
        for form, run in host:
            host_s = host[form, run]
            rate = [tokens / (max(d, host_s) + d / pack.calls) for d in device_s.values()]
            limit = (
                "host" if host_s > max(device_s.values()) else "device" if host_s < min(device_s.values()) else "either"
            )
            mark = ""
            if precision == "bfloat16":  # the target is a bfloat16 one
                mark = (
                    "  (target met)"
                    if min(rate) >= TARGET
                    else "  (target met if likely)"
                    if max(rate) >= TARGET
                    else "  (below the target)"
                )
            print(
                f"    {form:6s} {run:5s}: host {host_s:.2f} s -> {rate[0]:9,.0f} | {rate[1]:9,.0f} tokens/s, "
                f"{limit} bound{mark}"
            )

    # -- the training CLI -------------------------------------------------------------------
    print(
        "\nthe training CLI, `original`, 128 rows x 20 (2,560 tokens a step): host pipeline measured here "
        "(prefetch 2, V = 28,000, batches as fast as they come), device step measured on the H100:"
    )
    with tempfile.TemporaryDirectory() as tmp:
        vocab, path = zipf_corpus(tmp, 100_000, 600_000)
        tc = TrainConfig(n_tokens_vocab=28_000, batch_size=128, unroll_steps=20, n_negative_samples_batch=8192)
        host_ms = [1e3 * bench_host_pipeline(vocab, path, tc, 50, 2, 0) for _ in range(3)]
    print(f"  host per batch, 3 runs: {', '.join(f'{h:.1f}' for h in host_ms)} ms")
    for precision, (ms, _) in rates.items():
        rate = sorted({round(2560 / max(ms, h) * 1e3) for h in host_ms})
        print(
            f"  {precision}: device {ms:.2f} ms a step -> {' to '.join(f'{r:,}' for r in rate)} tokens/s "
            f"({'device' if ms > max(host_ms) else 'host'} bound)"
        )
    print(
        f"  the bfloat16 CLI stays device bound on a host up to {rates['bfloat16'][0] / max(host_ms):.1f}x slower "
        "per batch than this one"
    )


if __name__ == "__main__":
    main()
