"""Shared test helpers: XLA flags for test processes, the program in a subprocess, loading the
reference fixtures."""

import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys

import h5py
import numpy as np

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


def gpu_candidates():
    """The GPU's layout with every switch a GPU has yet to time (``gpu_measure.py``'s variant
    parts): the train-step tests run it here, so a GPU session can flip any of them on."""
    import dataclasses

    from elmo_jax.model.layout import BY_BACKEND

    return dataclasses.replace(BY_BACKEND["gpu"], lstm_wavefront=True, cnn_vjp=True)


# The suite compiles many small programs (about 1,100 backend compiles in the fast tier), and on
# CPU LLVM's optimisation passes are most of each compile: at -O1 without LLVM's expensive passes
# the suite took about a fifth less time than at the default level. XLA:CPU's older fusion
# emitters (--xla_cpu_use_fusion_emitters=false) compile the biLM's programs about a third faster
# again (they also lower a scatter to a loop, so compiled CPU text has none: test_hlo reads
# lowered HLO). XLA's HLO passes are the same at every level, and the reference-fixture tests pass
# at each; ELMO_JAX_TEST_XLA_OPT=default runs the suite at the level users get.
#
# A process with one device compiles at -O0, which halves the compiles again (the fast tier, all
# at -O0: 75 s of backend compiles against 159 s at -O1, benchmarks/pytest_compile_time.py;
# benchmarks/results/cpu/test_opt_levels.txt). Not with two devices: there -O0 code made a
# two-device evaluation stop at a collective until XLA's 40 s limit aborted the process
# (test_bilm_tf_training_check alone: 2 runs of 3 at -O0, none of 3 at -O1). A caller asks for
# ``level=1`` where a one-device process trains or embeds long (-O1 code runs several times
# faster: the collapse recipe's 100 steps took 69 s at -O0), or where its numbers are compared bit
# for bit with this process's (-O0 and -O1 round a few sums differently).
_COMMON = "--xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"
_DEFAULT_OPT = os.environ.get("ELMO_JAX_TEST_XLA_OPT") == "default"


def spelled_inputs(batch: dict) -> np.ndarray:
    """``[D, 2, B, T, max_chars]``: a batch's input words as char ids, decoded from ``chars`` and
    ``inputs`` (a batch's word table is its own, so batches compare by spelling, not by index)."""
    chars, inputs = batch["chars"], batch["inputs"]
    return np.stack([chars[k][inputs[k]] for k in range(chars.shape[0])])


def heavy_modules_loaded() -> list[str]:
    """Which of jax, jaxlib, flax and orbax this process has imported (run in a child process)."""
    return sorted(m for m in ("jax", "jaxlib", "flax", "orbax") if m in sys.modules)


CACHE_EVERY_PROCESS = pathlib.Path(__file__).parent / "cache_every_process"


def multiprocess_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` for one process of a multi-process run started by a test: every process, not only
    process 0, keeps its compiled programs in the persistent cache (``cache_every_process``), so
    the next test's processes load them rather than compile them again."""
    path = os.pathsep.join(p for p in (str(CACHE_EVERY_PROCESS), env.get("PYTHONPATH")) if p)
    return {**env, "PYTHONPATH": path}


def free_port() -> int:
    """A loopback TCP port nothing listens on (free when asked; a coordinator's, say)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def xla_flags(devices: int, level: int | None = None) -> str:
    """``XLA_FLAGS`` for a test process (this one, or a subprocess) with ``devices`` CPU devices, at
    XLA's optimisation ``level`` (default: 0 with one device, else 1; see above)."""
    level = (0 if devices == 1 else 1) if level is None else level
    opt = "" if _DEFAULT_OPT else f"--xla_backend_optimization_level={level} {_COMMON}"
    return f"--xla_force_host_platform_device_count={devices} {opt}".strip()


@contextlib.contextmanager
def compiled_programs():
    """The names of the programs XLA compiles while the block runs (``jit(f)``), in order. The
    persistent cache is off meanwhile: a program another test left on disk still counts."""
    import jax  # here, not at the top: conftest imports this module before XLA_FLAGS is set

    names: list[str] = []

    def listen(event, seconds, fun_name="", **_):
        if event == "/jax/core/compile/backend_compile_duration":
            names.append(fun_name)

    jax.monitoring.register_event_duration_secs_listener(listen)
    jax.config.update("jax_enable_compilation_cache", False)
    try:
        yield names
    finally:
        jax.config.update("jax_enable_compilation_cache", True)
        jax.monitoring.unregister_event_duration_listener(listen)


def run_elmo_jax(
    *args, devices: int = 1, timeout: float = 600, level: int | None = None, **env: str
) -> subprocess.CompletedProcess:
    """``python -m elmo_jax ARGS`` as a user runs it, with ``devices`` CPU devices (``level``: see
    ``xla_flags``) and ``env`` added to the environment: its exit code, and its whole stdout and
    stderr (what finalizers print at exit included)."""
    return subprocess.run(
        [sys.executable, "-m", "elmo_jax", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "XLA_FLAGS": xla_flags(devices, level), **env},
    )


# (model dir, sentences file) of the two public biLM fixtures.
REFERENCE_MODELS = {
    "allennlp": ("allennlp_elmo", "sentences.json"),
    "bilm_tf": ("bilm_tf_model", "lm_embeddings_sentences.json"),
}


def model_files(name: str) -> tuple[pathlib.Path, pathlib.Path]:
    d = FIXTURES / REFERENCE_MODELS[name][0]
    return d / "options.json", d / "lm_weights.hdf5"


def reference_batches(name: str):
    """The 10 x 3 stateful protocol: yields (batch of 3 token lists, 3 expected top layers)."""
    d, sentences_file = REFERENCE_MODELS[name]
    sentences = json.loads((FIXTURES / d / sentences_file).read_text())
    files = [h5py.File(FIXTURES / d / f"lm_embeddings_{k}.hdf5", "r") for k in range(3)]
    try:
        for i in range(10):
            batch = [sentences[k][i].split() for k in range(3)]
            # Stored as [2 (fwd, bwd), n_tokens, P]; the ELMo layer is the two side by side.
            expected = [np.concatenate(list(f[str(i)][...]), axis=-1) for f in files]
            yield batch, expected
    finally:
        for f in files:
            f.close()


def embed_sentences() -> list[list[str]]:
    """The AllenNLP fixture's sentences, tokenized, then an empty one, long and non-ASCII tokens, one word."""
    groups = json.loads((FIXTURES / "allennlp_elmo/sentences.json").read_text())
    out = [s.split() for g in groups for s in g]
    return out + [[], ["x" * 70, "東京", "🙂"], ["a"]]


def read_never_returns(at: int = 25) -> str:
    """A program: the CLI, whose training data reader never returns from its ``at``-th batch (a
    network file system that stopped answering), with one method patched (for ``python -c``)."""
    return f"""
import sys, time
from elmo_jax import cli
from elmo_jax.training import batches
real = batches.LMBatcher.next
calls = [0]
def next_batch_or_hang(self, *args, **kwargs):
    calls[0] += 1
    while calls[0] >= {at}:
        time.sleep(3600)
    return real(self, *args, **kwargs)
batches.LMBatcher.next = next_batch_or_hang
sys.exit(cli.main(sys.argv[1:]))
"""


# `python -c AS_FROM_A_TERMINAL ARGS` runs the CLI as `python -m elmo_jax ARGS` does, with SIGINT and
# SIGHUP handled as in a process started from a terminal, whatever the test runner ignores: a runner
# started under nohup ignores SIGHUP and a background one SIGINT, and children inherit that. (Not
# with preexec_fn: a fork of a process that runs jax's threads may deadlock.)
AS_FROM_A_TERMINAL = (
    "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
    "signal.signal(signal.SIGHUP, signal.SIG_DFL); from elmo_jax.cli import main; sys.exit(main())"
)
