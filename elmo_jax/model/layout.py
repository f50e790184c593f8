"""How the model's arrays are laid out and blocked per backend: a speed choice, never a result.

Every layout computes the same function (tests compare them). Each entry of the table was chosen
by a measurement; experiments/README.md, "The layout table", has the figures and their records.

| backend | lstm      | unroll | cnn_chunk | row_sums | cnn_vjp | why |
|---------|-----------|--------|-----------|----------|---------|-----|
| cpu     | "columns" | 1      | 32        | scatter  | True    | batch-minor matmuls run faster on XLA:CPU; blocks of 32 words keep the conv outputs in cache; sorted row sums no faster; the hand-written max backward faster |
| gpu     | "rows"    | 20     | 0         | sorted   | False   | each scan iteration and each char-CNN block costs kernel launches the step's small matmuls cannot hide: one block, and a whole bilm-tf window of 20 steps as straight-line code; sorted row sums are faster under XLA's deterministic-scatter flag |
| tpu     | "rows"    | 20     | 0         | scatter  | False   | not measured: the GPU's choice, but XLA's scatter-add until a TPU times the sorted sums |

Extraction (``elmo_jax.extract``) packs sentences end to end into rows and runs the biLSTM in calls
of ``extract_steps`` steps over ``extract_tokens // extract_steps`` rows per device:

| backend | extract_steps | extract_tokens | extract_copy_threads | why |
|---------|---------------|----------------|----------------------|-----|
| cpu     | 16            | 4096           | 1                    | 16, 32 and 64 steps a call alike, 16 the fewest sequential steps; XLA's own threads use the cores |
| gpu     | 40            | 16384          | 4                    | not measured on a GPU: two unrolled blocks of 20 a call, rows enough that the longest sentence sets the steps; more copy threads cut the host's share |
| tpu     | 40            | 16384          | 4                    | not measured: the GPU's choice |

Off on every backend until a GPU times them (``benchmarks/gpu_measure.py``'s parts): the rows
layout's time axis 2, the wavefront scan, and shared output blocks for extraction. The rows
layout's LSTM is differentiated by its hand-written backward pass; the CPU keeps the columns
layout and autodiff, which was not slower at 128 rows.
"""

from __future__ import annotations

import dataclasses

import jax

from elmo_jax.model.gather import SUMS


@dataclasses.dataclass(frozen=True)
class Layout:
    """How the model's arrays are laid out and blocked (the module's table has each backend's)."""

    lstm: str = "rows"
    """"columns" (state ``[2, D, B]``, batch minor) or "rows" (``[2, B, D]``)."""
    unroll: int = 1
    """Scan steps per loop iteration (1: none)."""
    cnn_chunk: int = 0
    """Tokens per char-CNN block (0: all tokens in one block)."""
    extract_steps: int = 40
    """Extraction's biLSTM steps per call."""
    extract_tokens: int = 16384
    """Extraction's token-steps per call and device (rows x steps)."""
    lstm_vjp: bool = True
    """The rows layout's LSTM is differentiated by its hand-written backward pass
    (``lstm._rows_scan_vjp``: weight gradients as one matmul after the reverse scan, not
    accumulated inside it) instead of autodiff of the scan; the same gradients. The columns layout
    always uses autodiff."""
    row_sums: str = "scatter"
    """How the gradients of the step's row gathers (char embeddings, token vectors, target softmax
    rows) add repeated rows: "scatter" (XLA's scatter-add) or "sorted" (``elmo_jax.model.gather``:
    sort the row indices, sum runs; no sort of every scalar under XLA's deterministic-scatter flag)."""
    lstm_time_axis: int = 0
    """Where the rows layout keeps time in its per-step arrays: 0, time-major (``[T, 2, B, ...]``,
    as ``lax.scan`` stacks them), or 2 (``[2, B, T, ...]``, as the layer's input; the loop written
    out in Python when ``unroll`` covers every step), which spares XLA the transposes of the
    ``[..., 4D]`` gate arrays around the matmuls over all steps."""
    cnn_vjp: bool = False
    """Each char-CNN filter's max over positions is differentiated by its hand-written backward
    pass (``char_cnn._dot_max_vjp``: where the maxima lie kept as a bool mask, not autodiff's float
    one); the same gradients, ties split as autodiff splits them."""
    extract_copy_threads: int = 4
    """Threads (at most the host's CPUs) that copy extraction's outputs into the sentences' arrays
    (1: the calling thread alone)."""
    lstm_wavefront: bool = False
    """The rows layout runs all LSTM layers in one scan, layer ``l``'s step ``t`` at step ``t + l``
    (``elmo_jax.model.wavefront``): ``T + n_layers - 1`` sequential steps instead of
    ``n_layers x T``, each a matmul over every layer; the same function. It is time-major and has
    its own backward pass, so ``lstm_time_axis`` and ``lstm_vjp`` do not apply to it."""
    extract_block_mib: int = 0
    """Extraction's per-sentence arrays are views into shared blocks of at least this many MiB,
    one allocation a block, instead of one allocation a sentence (0); see
    ``elmo_jax.extract.packing.new_outputs``."""

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
