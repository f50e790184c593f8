"""The train step under each precision and layout choice, in one process, and a profile of one.

    python benchmarks/bench_variants.py --shape original --batch 128 [--variants f32 bf16 ...]
        [--profile bf16 --profile-out DIR]

Each variant prints its line as soon as it is measured (a timeout keeps the lines before it).
Figures: median ms per step over ``--steps`` steps, tokens/s (rows x 20, counted once), the
FLOP/s executed (``bench_train.train_flops``) as a share of the card's datasheet dense peak and of
the matmul rate measured in the same run (``harness.roofline``: the slope of dependent matmuls in
one ``fori_loop``, 8192^3 on a GPU, ``--roofline-size`` to change), each in the variant's dtype. ``--profile NAME`` traces that variant's timed steps with ``jax.profiler`` and
writes ``profile_top.txt``: device time per part of the step (the ``jax.named_scope`` names of
``train_step``) and the top 20 ops, so that only a small text file need come back.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import tempfile

import jax
import jax.numpy as jnp
import numpy as np
from bench_train import device_batches, model_and_config, time_step, train_flops, zipf_corpus
from harness import mfu, roofline_report
from jax.sharding import Mesh

from elmo_jax.config import TrainConfig
from elmo_jax.model.compute import Compute
from elmo_jax.model.layout import Layout, for_backend
from elmo_jax.training.step import AXIS

_PRESET = jax.lax.DotAlgorithmPreset
# name -> (precision, compute dtype, layout). "f32" with rows/1/32 is the layout every GPU ran before
# elmo_jax.model.layout existed: the baseline.
VARIANTS = {
    "f32": Compute("highest", jnp.float32, Layout("rows", 1, 32)),
    "tf32": Compute(_PRESET.TF32_TF32_F32, jnp.float32, Layout("rows", 1, 32)),
    "bf16": Compute("default", jnp.bfloat16, Layout("rows", 1, 32)),
    "bf16-preset": Compute(_PRESET.BF16_BF16_F32, jnp.float32, Layout("rows", 1, 32)),
    "bf16-c0": Compute("default", jnp.bfloat16, Layout("rows", 1, 0)),
    "bf16-c256": Compute("default", jnp.bfloat16, Layout("rows", 1, 256)),
    "bf16-c0-u2": Compute("default", jnp.bfloat16, Layout("rows", 2, 0)),
    "bf16-c0-u5": Compute("default", jnp.bfloat16, Layout("rows", 5, 0)),
    "bf16-c0-u20": Compute("default", jnp.bfloat16, Layout("rows", 20, 0)),
    "f32-c0": Compute("highest", jnp.float32, Layout("rows", 1, 0)),
    "f32-c0-u5": Compute("highest", jnp.float32, Layout("rows", 5, 0)),
    "cpu": Compute("highest", jnp.float32, Layout("columns", 1, 32)),
    # The library's defaults on a GPU today: training's bfloat16 policy, and float32 (extraction's).
    "gpu": Compute.from_policy("bfloat16", layout=for_backend("gpu")),
    "gpu-f32": Compute.from_policy("float32", layout=for_backend("gpu")),
}

PARTS = ("char_cnn", "lstm", "softmax_rows", "softmax", "optimizer")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its ``op_name`` (the JAX name stack) in compiled HLO text.

    A GPU trace names each kernel's HLO instruction (``hlo_op``) but, from jax 0.11 on, gives
    ``XlaModule:`` as its name stack (``tf_op``), so the parts of the step come from the compiled
    module's metadata instead. A fusion without metadata of its own takes the first ``op_name``
    inside the computation it calls.
    """
    scopes, calls, inside, current = {}, {}, collections.defaultdict(list), None
    for line in hlo_text.splitlines():
        if (m := _COMPUTATION.match(line)) and "=" not in line.split("{")[0]:
            current = m.group(1)
            continue
        if not (m := _INSTRUCTION.match(line)):
            continue
        name, rest = m.groups()
        if op := re.search(r'op_name="([^"]*)"', rest):
            scopes[name] = op.group(1)
            inside[current].append(op.group(1))
        elif callee := re.search(r"calls=%?([\w.\-]+)", rest):
            calls[name] = callee.group(1)
    for name, callee in calls.items():
        if inside.get(callee):
            scopes[name] = inside[callee][0]
    return scopes


def part_of(scope: str) -> str:
    """The part of the train step (``PARTS``, "lstm (backward)", or "other") a name stack belongs to."""
    part = next((p for p in PARTS if re.search(rf"\b{p}\b", scope)), "other")
    # The backward pass of the scan is a while loop too; keep it apart from the forward.
    return "lstm (backward)" if part == "lstm" and "transpose" in scope else part


def summarize_trace(trace_dir: str, steps: int, wall_s: float, hlo_text: str = "") -> str:
    """A text summary of the device events of the newest trace under ``trace_dir``; ``hlo_text``
    (the compiled step's ``as_text()``) names the part of the step each kernel belongs to."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        return "no trace written\n"
    data = ProfileData.from_file(paths[-1])
    by_op = collections.Counter()
    by_part, part_kernels = collections.Counter(), collections.Counter()
    where = {}
    kernels = 0
    device_planes = [p for p in data.planes if p.name.startswith("/device:")]
    scopes, seen = hlo_scopes(hlo_text), []
    for plane in device_planes:
        for line in plane.lines:
            events = list(line.events)
            if events:
                seen.append(
                    f"{plane.name} | {line.name}: {len(events)} events, stats {[k for k, _ in events[0].stats]}"
                )
    for plane in device_planes:
        for line in plane.lines:
            if "stream" not in line.name.lower():
                continue  # the "XLA Ops"/"XLA Modules" lines repeat the stream events
            for e in line.events:
                stats = {k: str(v) for k, v in e.stats}
                op = stats.get("hlo_op", e.name)
                scope = scopes.get(op) or stats.get("tf_op", "")
                kernels += 1
                by_op[op] += e.duration_ns
                where.setdefault(op, (e.name[:60], scope[-100:]))
                part = part_of(scope)
                by_part[part] += e.duration_ns
                part_kernels[part] += 1
    busy = sum(by_op.values()) / 1e6
    lines = [
        "lines: " + "\n  ".join(seen[:12]),
        f"per step: wall {wall_s * 1e3:.1f} ms, device busy {busy / steps:.1f} ms "
        f"({100 * busy / steps / (wall_s * 1e3):.0f}%), {kernels / steps:.0f} kernels, "
        f"{len(scopes)} HLO instructions with a name stack",
        "device time per part of the step (ms per step, kernels per step):",
    ]
    lines += [
        f"  {part:<16} {ns / 1e6 / steps:8.2f} {part_kernels[part] / steps:6.0f}" for part, ns in by_part.most_common()
    ]
    lines.append("top 20 ops (ms per step, kernel, name stack):")
    for op, ns in by_op.most_common(20):
        kname, scope = where[op]
        lines.append(f"  {ns / 1e6 / steps:7.2f}  {op[:40]:<40} {kname:<60} {scope}")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--negatives", type=int, default=8192)
    ap.add_argument("--vocab", type=int, default=100_000)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument(
        "--reset-state-prob",
        type=float,
        default=TrainConfig.reset_state_prob,
        help="TrainConfig.reset_state_prob (default: its default)",
    )
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--profile", choices=list(VARIANTS), help="trace this variant's timed steps")
    ap.add_argument("--profile-out", default=".", help="where profile_top.txt goes")
    ap.add_argument("--roofline-size", type=int, help="n of the roofline's n^3 matmuls (default: harness.roofline's)")
    args = ap.parse_args()
    args.vocabs = [args.vocab]
    model, tc = model_and_config(args, args.vocab)
    mesh = Mesh(np.array(jax.local_devices()[:1]), (AXIS,))
    lines, measured = roofline_report(args.roofline_size)
    print("\n".join(lines), flush=True)
    kind = jax.devices()[0].device_kind
    with tempfile.TemporaryDirectory() as tmp:
        vocab, path = zipf_corpus(tmp, args.vocab, 300_000)
        batches, width, capacity = device_batches(args, model, tc, vocab, path, mesh)
        flops = train_flops(model, tc, width)
        print(
            f"{args.shape}, {args.batch} rows x 20, V={args.vocab:,}, {width} distinct-word rows, "
            f"{flops / 1e9:,.0f} GFLOP a step",
            flush=True,
        )
        names = list(args.variants)
        if args.profile and args.profile not in names:
            names.append(args.profile)
        for name in names:
            compute = VARIANTS[name]
            trace = os.path.join(tmp, "trace") if name == args.profile else None
            try:
                sec, compiled = time_step(model, tc, mesh, batches, compute=compute, trace_dir=trace)
            except Exception as e:  # noqa: BLE001 - a variant a backend rejects (tf32 on a CPU) must not stop the rest
                print(f"{name:<12} failed: {type(e).__name__}: {str(e).splitlines()[0][:150]}", flush=True)
                continue
            rate = flops / sec / 1e9
            # The roofline dtype the variant's matmuls run in (its MFU denominators).
            kind_of = (
                "bfloat16"
                if np.dtype(compute.dtype) == jnp.bfloat16 or name == "bf16-preset"
                else "tf32"
                if name == "tf32"
                else "float32"
            )
            print(
                f"{name:<12} {sec * 1e3:8.2f} ms/step {args.batch * 20 / sec:9.0f} tokens/s {rate:9,.0f} GFLOP/s "
                f"({mfu(rate / 1e3, kind_of, kind, measured)})  "
                f"[{np.dtype(compute.dtype).name}, {getattr(compute.precision, 'name', compute.precision)}, "
                f"{compute.layout}]",
                flush=True,
            )
            if trace:
                text = summarize_trace(trace, args.steps, sec, compiled.as_text())
                os.makedirs(args.profile_out, exist_ok=True)
                with open(os.path.join(args.profile_out, "profile_top.txt"), "w") as f:
                    f.write(f"{name}: {args.shape}, {args.batch} rows x 20\n" + text)
                print(text, flush=True)


if __name__ == "__main__":
    main()
