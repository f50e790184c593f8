"""benchmarks/bench_embed.py: the per-phase split of an ``embed`` call's wall time."""

import bench_embed
import numpy as np
from helpers import embed_sentences, model_files

from elmo_jax import load_hdf5
from elmo_jax.extract import embedder as module
from elmo_jax.extract.embedder import Embedder
from elmo_jax.extract.packing import Packing


def test_phases_split_the_call_and_leave_the_embedder_as_it_was():
    config, params = load_hdf5(*(str(p) for p in model_files("allennlp")))
    embedder = Embedder(config, params, devices=1, batch_tokens=64)
    sentences = embed_sentences()
    originals = (Embedder._token_table, Embedder._run_packed, module.new_outputs, Packing.scatter, embedder._packed)
    expected = embedder.embed(sentences)
    with bench_embed.Phases(embedder) as phases:
        assert embedder._packed is not originals[-1]  # not vacuous: the wrappers were in place
        out = embedder.embed(sentences)
    seconds = phases.seconds
    # Every phase ran, and the biLSTM calls contain their parts.
    for key in ("token table", "biLSTM calls", "dispatch", "output arrays", "copies into them"):
        assert seconds[key] > 0, key
    assert seconds["biLSTM calls"] > seconds["dispatch"] + seconds["output arrays"] + seconds["copies into them"]
    assert phases.line(10.0).startswith("token table ")
    # Timing changes nothing, and the wrappers are gone afterwards.
    for a, b in zip(out, expected):
        np.testing.assert_array_equal(a, b)
    now = (Embedder._token_table, Embedder._run_packed, module.new_outputs, Packing.scatter, embedder._packed)
    assert all(x is y for x, y in zip(now, originals))
