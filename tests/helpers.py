"""Shared test helpers: XLA flags for test processes, the program in a subprocess, loading the
reference fixtures."""

import json
import os
import pathlib
import subprocess
import sys

import h5py
import numpy as np

FIXTURES = pathlib.Path(__file__).parent / "fixtures"

# The suite compiles many small programs, and on CPU LLVM's optimisation passes are much of the
# compile time. At -O1 without LLVM's expensive passes the suite takes about a fifth less time
# (test_lstm_vjp.py and test_bilm.py: 125 s at the default level, 85 s at -O1, then 108 s against
# 97 s without those passes on a slower hour). XLA's HLO passes are the same; the reference-fixture
# tests pass at both levels, and ELMO_JAX_TEST_XLA_OPT=default runs the suite at the level users
# get. Not -O0: there a two-device evaluation test aborted, its devices not meeting at a collective
# within XLA's 40 s. XLA:CPU's older fusion emitters (--xla_cpu_use_fusion_emitters=false) compile
# the biLM's programs about a third faster again: test_bilm, test_lstm_vjp and test_embed's fast
# tests spent 141 s in 640 backend compiles, 91 s with them (3:08 -> 2:20 for the three files;
# benchmarks/pytest_compile_time.py adds those up).
# They lower a scatter to a loop, so compiled CPU text has none (test_hlo reads lowered HLO).
OPT_FLAGS = (
    ""
    if os.environ.get("ELMO_JAX_TEST_XLA_OPT") == "default"
    else "--xla_backend_optimization_level=1 --xla_llvm_disable_expensive_passes=true --xla_cpu_use_fusion_emitters=false"
)


def xla_flags(devices: int) -> str:
    """``XLA_FLAGS`` for a test process (this one, or a subprocess) with ``devices`` CPU devices."""
    return f"--xla_force_host_platform_device_count={devices} {OPT_FLAGS}".strip()


def run_elmo_jax(*args, devices: int = 1, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    """``python -m elmo_jax ARGS`` as a user runs it, with ``devices`` CPU devices and ``env`` added
    to the environment: its exit code, and its whole stdout and stderr (what finalizers print at
    exit included)."""
    return subprocess.run(
        [sys.executable, "-m", "elmo_jax", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "XLA_FLAGS": xla_flags(devices), **env},
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
