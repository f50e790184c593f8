"""Where a train step's time goes: a ``jax.profiler`` trace of the step, summed per part.

    python benchmarks/profile_parts.py [--shape small] [--batch 32] [--vocab 100000] [--steps 5]
        [--precision float32] [--out DIR]

The step is the library's default on this backend (``policy.training_default``, the backend's
layout) unless ``--precision`` says otherwise. The table has one row per part of the step, forward
and backward apart:

- ``char CNN``, ``LSTM``, ``softmax`` (the sampled softmax and its row fetch and update),
  ``optimizer``: the ``jax.named_scope`` names of ``training/step.py``;
- ``dropout RNG``: the threefry draws of the dropout masks (inside the LSTM's scope, kept apart
  because they are not the LSTM's arithmetic);
- ``other``: what no scope names (the loss's sums, the gradient norm, copies);
- ``idle``: wall time in which no kernel of the step ran (launch gaps, host waits, syncs).

How a kernel finds its part: a trace event names its HLO instruction (``hlo_op``). On a GPU from
jax 0.11 on its name stack (``tf_op``) is just ``XlaModule:``, so the name stack comes from the
compiled module's ``op_name`` metadata instead (``hlo_scopes``). A GPU's kernels are the events of
its stream lines; a CPU runs the same instructions as thunks on host threads, where a while loop's
thunk holds its body's, so only the innermost events count there.
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
# (part, pattern on the name stack), first match wins: the RNG sits inside the LSTM's scope.
PARTS = (
    ("dropout RNG", r"_bernoulli|_uniform|threefry|_row_keys"),
    ("char CNN", r"\bchar_cnn\b"),
    ("LSTM", r"\blstm\b"),
    ("softmax", r"\bsoftmax(_rows)?\b"),
    ("optimizer", r"\boptimizer\b"),
)


def hlo_scopes(hlo_text: str) -> dict[str, str]:
    """Instruction name -> its ``op_name`` (the JAX name stack) in compiled HLO text. A fusion
    without metadata of its own takes the first ``op_name`` inside the computation it calls."""
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


def part_of(scope: str) -> tuple[str, str]:
    """(part, "forward" or "backward") of a name stack; autodiff's backward pass (a custom VJP's
    included) runs under ``transpose(...)``."""
    part = next((name for name, pattern in PARTS if re.search(pattern, scope)), "other")
    return part, "backward" if "transpose(" in scope else "forward"


@dataclass(frozen=True)
class Kernel:
    op: str  # the HLO instruction
    name: str  # the event's (a GPU's kernel name)
    start_ns: float
    ns: float


def kernels(trace_dir: str, module: str = "") -> list[Kernel]:
    """The kernels of the newest trace under ``trace_dir``: a GPU's stream events, else (a CPU)
    the innermost thunk events of HLO module ``module`` (any module when empty)."""
    from jax.profiler import ProfileData

    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.xplane.pb"), recursive=True))
    if not paths:
        return []
    planes = list(ProfileData.from_file(paths[-1]).planes)  # an iterator
    device = [p for p in planes if p.name.startswith("/device:") and "CPU" not in p.name]
    out = []
    if device:
        for plane in device:
            for line in plane.lines:
                if "stream" in line.name.lower():  # "XLA Ops"/"XLA Modules" repeat the stream events
                    for e in line.events:
                        op = dict(e.stats).get("hlo_op", e.name)
                        out.append(Kernel(str(op), e.name, e.start_ns, e.duration_ns))
        return out
    for plane in planes:
        for line in plane.lines:
            events = []
            for e in line.events:
                stats = {k: str(v) for k, v in e.stats}
                if "hlo_op" in stats and (not module or stats.get("hlo_module") == module):
                    events.append(Kernel(stats["hlo_op"], e.name, e.start_ns, e.duration_ns))
            events.sort(key=lambda k: k.start_ns)
            for k, after in zip(events, [*events[1:], None]):
                if after is None or after.start_ns >= k.start_ns + k.ns:  # holds no other event
                    out.append(k)
    return out


def busy_ns(ks: list[Kernel]) -> float:
    """Wall time covered by at least one kernel (overlapping kernels counted once)."""
    total, end = 0.0, float("-inf")
    for k in sorted(ks, key=lambda k: k.start_ns):
        lo, hi = max(k.start_ns, end), k.start_ns + k.ns
        if hi > lo:
            total += hi - lo
        end = max(end, hi)
    return total


def table(ks: list[Kernel], hlo_text: str, steps: int, wall_s: float) -> list[str]:
    """The per-part table (ms per step, forward / backward / share of the wall) and the top ops."""
    scopes = hlo_scopes(hlo_text)
    by = collections.Counter()
    by_op = collections.Counter()
    where = {}
    for k in ks:
        scope = scopes.get(k.op, "")
        by[part_of(scope)] += k.ns
        by_op[k.op] += k.ns
        where.setdefault(k.op, (k.name[:50], re.sub(r"\[[^\]]*\]", "", scope)[-90:]))
    wall = wall_s * 1e3 * steps  # ms over the traced steps
    idle = max(wall - busy_ns(ks) / 1e6, 0.0)
    named = sum(1 for k in ks if k.op in scopes)
    lines = [
        f"per step: wall {wall_s * 1e3:.2f} ms, {len(ks) / steps:.0f} kernels "
        f"({100 * named / max(len(ks), 1):.0f}% found in the module's name stacks), "
        f"kernel time {sum(by.values()) / 1e6 / steps:.2f} ms (summed over streams/threads)",
        f"{'part':<14} {'forward':>9} {'backward':>9} {'total':>9} {'share':>7}   (ms per step; share of the kernel time)",
    ]
    parts = [name for name, _ in PARTS] + ["other"]
    total = max(sum(by.values()), 1.0)
    for part in sorted(parts, key=lambda p: -(by[(p, "forward")] + by[(p, "backward")])):
        f, b = by[(part, "forward")], by[(part, "backward")]
        lines.append(
            f"{part:<14} {f / 1e6 / steps:9.2f} {b / 1e6 / steps:9.2f} {(f + b) / 1e6 / steps:9.2f} "
            f"{100 * (f + b) / total:6.1f}%"
        )
    lines.append(f"{'idle':<14} {'':9} {'':9} {idle / steps:9.2f} {100 * idle / wall:6.1f}% of the wall")
    lines.append("top 15 ops (ms per step, kernel, name stack):")
    for op, ns in by_op.most_common(15):
        name, scope = where[op]
        lines.append(f"  {ns / 1e6 / steps:7.2f}  {op[:32]:<32} {name:<50} {scope}")
    # "other" is what no part's pattern claims, and the kernels the name stacks do not know:
    # its own top ops say which of the two it is, and what to name next.
    other = [(op, ns) for op, ns in by_op.most_common() if part_of(scopes.get(op, ""))[0] == "other"][:10]
    lines.append("top 10 ops of 'other' (ms per step, kernel, name stack or '(not in the name stacks)'):")
    for op, ns in other:
        name, scope = where[op]
        lines.append(f"  {ns / 1e6 / steps:7.2f}  {op[:32]:<32} {name:<50} {scope or '(not in the name stacks)'}")
    return lines


def module_name(hlo_text: str) -> str:
    """The ``HloModule`` name of compiled HLO text (what a CPU trace's events name), or ""."""
    module = re.search(r"HloModule\s+([\w.\-]+)", hlo_text)
    return module.group(1) if module else ""


def profile_lines(trace_dir: str, timing, steps: int) -> list[str]:
    """The table of a ``bench_train.time_step`` run with ``trace_dir`` (its traced pass)."""
    text = timing.compiled.as_text()
    return table(kernels(trace_dir, module_name(text)), text, steps, timing.traced_seconds)


def main() -> None:
    import sys
    import tempfile

    import jax
    import numpy as np
    from bench_train import device_batches, model_and_config, time_step, zipf_corpus
    from jax.sharding import Mesh

    from elmo_jax import policy
    from elmo_jax.config import TrainConfig
    from elmo_jax.model.compute import Compute
    from elmo_jax.model.layout import for_backend
    from elmo_jax.training.step import AXIS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=100_000)
    ap.add_argument("--negatives", type=int, default=8192)
    ap.add_argument("--steps", type=int, default=5, help="traced steps (one more warms up)")
    ap.add_argument("--precision", choices=["float32", "tf32", "bfloat16"], help="default: the backend's")
    ap.add_argument("--out", help="also write DIR/profile_<shape>_<batch>.txt")
    args = ap.parse_args()
    args.reset_state_prob = TrainConfig.reset_state_prob
    device = jax.devices()[0]
    name = args.precision or policy.training_default(device)[0]
    compute = Compute.from_policy(name, layout=for_backend())
    model, tc = model_and_config(args, args.vocab)
    mesh = Mesh(np.array(jax.local_devices()[:1]), (AXIS,))
    with tempfile.TemporaryDirectory() as tmp:
        vocab, path = zipf_corpus(tmp, args.vocab, max(200_000, args.batch * 20 * (args.steps + 4)))
        batches, _, _ = device_batches(args, model, tc, vocab, path, mesh)
        trace = os.path.join(tmp, "trace")
        timing = time_step(model, tc, mesh, batches, compute=compute, trace_dir=trace)
        table_lines = profile_lines(trace, timing, len(batches) - 1)
    lines = [
        f"{' '.join(sys.argv[1:]) or '(defaults)'}: {args.shape}, {args.batch} rows x 20, V={args.vocab:,}, "
        f"{args.negatives:,} negatives, {name} [{compute.layout}]; {device.device_kind}, jax {jax.__version__}",
        f"untraced: {timing.seconds * 1e3:.2f} ms a step (median of {len(batches) - 1}); the table is of the same "
        f"steps run again under the profiler ({timing.traced_seconds * 1e3:.2f} ms a step)",
        *table_lines,
    ]
    print("\n".join(lines))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"profile_{args.shape}_{args.batch}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
