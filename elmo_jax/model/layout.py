"""How the model's arrays are laid out and blocked per backend: a speed choice, never a result.

Every layout computes the same function (tests compare them). The table below is measured:
``benchmarks/bench_bilm.py`` (CPU) and ``benchmarks/bench_variants.py`` (GPU) print the figures
behind each entry, and experiments/README.md records them.

| backend | lstm      | unroll | cnn_chunk | row_sums | cnn_vjp | measured |
|---------|-----------|--------|-----------|----------|---------|----------|
| cpu     | "columns" | 1      | 32        | scatter  | True    | batch-minor matmuls run faster on XLA:CPU; blocks of 32 words keep the conv outputs in cache; row sums alike within this machine's noise (`small`, 32 x 20: 1,661-1,827 ms a step with scatter, 1,692-1,879 sorted, `benchmarks/results/cpu/row_sums.txt`), so XLA's scatter-add stays |
| gpu     | "rows"    | 20     | 0         | sorted   | False   | H100, `original`, 128 x 20, bfloat16: 29.9 ms a step with (rows, 1, 32), 20.6 with chunk 0, 18.3 with unroll 5, 15.0 with unroll 20; H200, same step under XLA's deterministic-scatter flag (as `elmo-jax train` runs): 16.39 ms with scatter, 13.64 with sorted (`benchmarks/results/gpu_h200/s4_row_sums.txt`) |
| tpu     | "rows"    | 20     | 0         | scatter  | False   | not measured: the GPU's choice, except the row sums, which stay XLA's scatter-add until a TPU times the sorted ones |

Extraction (``elmo_jax.extract.embedder``) packs sentences end to end into rows and runs the biLSTM in calls
of ``extract_steps`` steps over ``extract_tokens // extract_steps`` rows per device, and copies
each call's outputs into the sentences' arrays in ``extract_copy_threads`` threads:

| backend | extract_steps | extract_tokens | extract_copy_threads | measured |
|---------|---------------|----------------|----------------------|----------|
| cpu     | 16            | 4096           | 1                    | `small`, the experiments' held-out job, warm (`benchmarks/results/cpu/extract_packing.txt`): 16 steps a call (256 rows) 7,963-8,226 tokens/s, 32 (128 rows) 7,994-8,120, 64 (64 rows) 6,890-8,289: alike within this machine's noise (807c246's length-bucketed batches: 6,099, same session); 16 has the fewest sequential steps. One copy thread: XLA's own threads run the biLSTM on the same cores, and the copies are a small share of a CPU job (`small`, the sample's 45,668 held-out tokens: 31-81 ms with no device work, ``--host-only cpu``, against about 2.4 s for the whole job warm, `compare_3a7f5a2.txt`) |
| gpu     | 40            | 16384          | 4                    | not measured: two unrolled blocks of 20 a call, and rows enough that the job's longest sentence, not the row count, sets the sequential steps (experiments/README.md, "What the extraction target asks of the GPU"). The copies: on the 2-core CPU with no device work (``bench_embed.py --host-only gpu``, `original`, the sample's 45,668 held-out tokens, every layer), 2 threads took the host's share from 218-221 ms to 114-143 (``benchmarks/results/cpu/extract_host_threads.txt``); an H200's host spent 650-665 ms of a 1.24 s job on them |
| tpu     | 40            | 16384          | 4                    | not measured: the GPU's choice |

``extract_block_mib`` is 0 everywhere (an array a sentence) until a GPU times it (``gpu_measure.py``'s
``extract`` part runs the job with 0 and 64). On the 2-core CPU with no device work (``bench_embed.py
--host-only gpu --blocks 0 64``, `original`, the sample's 45,668 held-out tokens, every layer; a fresh
process each, ``benchmarks/results/cpu/extract_blocks.txt``), 64 MiB blocks cut the minor page
faults of a pass from 87,000-137,000 to about 5,000 and, once the process had run a job, the host's
share from 158-170 ms to 92 ms (202 in the other process); but in each process's first job the
new arrays and layer 0 took 512-540 ms, not 82-85, the kernel compacting memory to find its first
2 MiB pages.

The rows layout's LSTM is differentiated by its hand-written backward pass (``lstm_vjp``: weight
gradients as one matmul after the reverse scan, not accumulated in it). On this project's 2-core CPU
(``benchmarks/bench_grad.py``, ``benchmarks/results/cpu/lstm_grad.txt``), the biLSTM's gradient at
`small`, 32 x 20: rows with it 285 ms, rows by autodiff 386, columns by autodiff 357; at 128 rows
2,226, 2,610 and 2,225. The CPU keeps columns (not a clear win at 128 rows, and extraction's forward
pass prefers columns); on a GPU it is not yet measured.

The char CNN's max over positions is differentiated by hand where ``cnn_vjp`` is set (the
positions of the maxima kept as a bool mask, not autodiff's float one). On the 2-core CPU
(``benchmarks/bench_grad.py --part cnn``, ``benchmarks/results/cpu/cnn_grad.txt``), the char
CNN's gradient over 512 words at `small`: 173 ms with it, 309 by autodiff (best of 5 rounds); the
`small` train step at 32 rows ran 33.7 % faster (``benchmarks/results/cpu/compare_3a7f5a2.txt``).
The GPU keeps autodiff until a GPU times it (``gpu_measure.py``'s ``cnnvjp128`` part).

``lstm_wavefront`` (``elmo_jax.model.wavefront``) is off everywhere until a GPU times it
(``wave128``, ``wave384``). On the 2-core CPU the biLSTM's gradient at `small`, 32 x 20, took
147.3 ms with it against 138.0 with the rows layout's layers one after the other (best of 5,
``benchmarks/results/cpu/lstm_grad_wavefront.txt``): a CPU pays for FLOPs, not for steps.

On a GPU the char CNN in blocks is a serial loop of small kernels, and each scan iteration costs
kernel launches and loop bookkeeping that the step's small matmuls cannot hide; unroll 20 (a whole
bilm-tf window) makes the training scan straight-line code, and longer extraction sequences run
in blocks of 20 steps.
"""

from __future__ import annotations

import dataclasses

import jax

from elmo_jax.model.gather import SUMS


@dataclasses.dataclass(frozen=True)
class Layout:
    """``lstm``: "columns" (state ``[2, D, B]``, batch minor) or "rows" (``[2, B, D]``).
    ``unroll``: scan steps per loop iteration (1: none). ``cnn_chunk``: tokens per char-CNN block
    (0: all tokens in one block). ``extract_steps``, ``extract_tokens``: extraction's biLSTM
    steps per call and token-steps per call and device (rows x steps). ``lstm_vjp``: the rows
    layout's LSTM is differentiated by its hand-written backward pass (``lstm._rows_scan_vjp``:
    weight gradients after the reverse scan, not accumulated inside it) instead of autodiff of
    the scan; the same gradients. The columns layout always uses autodiff. ``row_sums``: how the
    gradients of the step's row gathers (char embeddings, token vectors, target softmax rows) add
    repeated rows, "scatter" (XLA's scatter-add) or "sorted" (``elmo_jax.model.gather``: sort the
    row indices, sum runs; no sort of every scalar under XLA's deterministic-scatter flag).
    ``lstm_time_axis``: where the rows layout keeps time in its per-step arrays: 0, time-major
    (``[T, 2, B, ...]``, as ``lax.scan`` stacks them), or 2 (``[2, B, T, ...]``, as the layer's
    input; the loop written out in Python when ``unroll`` covers every step), which spares XLA
    the transposes of the ``[.., 4D]`` gate arrays around the matmuls over all steps (0.2-0.4
    ms each in an H200 profile of the 128-row step) but is not yet timed on a GPU. ``cnn_vjp``:
    each char-CNN filter's max over positions is differentiated by its hand-written backward
    pass (``char_cnn._window_max``: where the maxima lie kept as a bool mask, not autodiff's
    float one); the same gradients, ties split as autodiff splits them.
    ``extract_copy_threads``: threads (at most the host's CPUs) that copy extraction's outputs
    into the sentences' arrays, ``Embedder.embed`` with every layer or one (1: the calling
    thread alone). ``lstm_wavefront``: the rows layout runs all LSTM layers in one scan, layer
    ``l``'s step ``t`` at step ``t + l`` (``elmo_jax.model.wavefront``): ``T + n_layers - 1``
    sequential steps instead of ``n_layers x T``, each a matmul over every layer; the same
    function, not yet timed on a GPU. It is time-major and has its own backward pass, so
    ``lstm_time_axis`` and ``lstm_vjp`` do not apply to it. ``extract_block_mib``: extraction's
    per-sentence arrays (every layer, or one) are views into shared blocks of at least this many
    MiB, one allocation a block, instead of one allocation a sentence (0); see
    ``elmo_jax.extract.packing.new_outputs``."""

    lstm: str = "rows"
    unroll: int = 1
    cnn_chunk: int = 0
    extract_steps: int = 40
    extract_tokens: int = 16384
    lstm_vjp: bool = True
    row_sums: str = "scatter"
    lstm_time_axis: int = 0
    cnn_vjp: bool = False
    extract_copy_threads: int = 4
    lstm_wavefront: bool = False
    extract_block_mib: int = 0

    def __post_init__(self):
        if self.lstm not in ("rows", "columns"):
            raise ValueError(f"Layout.lstm must be 'rows' or 'columns', got {self.lstm!r}")
        if self.lstm_time_axis not in (0, 2):
            raise ValueError(f"Layout.lstm_time_axis must be 0 or 2, got {self.lstm_time_axis!r}")
        if self.row_sums not in SUMS:
            raise ValueError(f"Layout.row_sums must be one of {SUMS}, got {self.row_sums!r}")
        if (
            min(self.unroll, self.extract_steps, self.extract_tokens, self.extract_copy_threads) < 1
            or min(self.cnn_chunk, self.extract_block_mib) < 0
        ):
            raise ValueError(
                "Layout needs unroll, extract_steps, extract_tokens and extract_copy_threads >= 1 and "
                f"cnn_chunk and extract_block_mib >= 0, got {self}"
            )


BY_BACKEND = {
    "cpu": Layout(
        lstm="columns",
        unroll=1,
        cnn_chunk=32,
        extract_steps=16,
        extract_tokens=4096,
        cnn_vjp=True,
        extract_copy_threads=1,
    ),
    "gpu": Layout(lstm="rows", unroll=20, cnn_chunk=0, extract_steps=40, extract_tokens=16384, row_sums="sorted"),
    "tpu": Layout(lstm="rows", unroll=20, cnn_chunk=0, extract_steps=40, extract_tokens=16384, row_sums="scatter"),
}


def for_backend(backend: str | None = None) -> Layout:
    """The table's layout for ``backend`` (default: JAX's default backend, read when tracing)."""
    backend = backend or jax.default_backend()
    return BY_BACKEND.get(backend, BY_BACKEND["gpu"])
