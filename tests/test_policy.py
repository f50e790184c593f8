"""The precision policy (elmo_jax.policy): names, defaults, and where it is used."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from elmo_jax import policy
from elmo_jax.model.compute import Compute
from elmo_jax import load_hdf5
from elmo_jax.cli import main as cli_main
from helpers import model_files


def tiny_model():
    return load_hdf5(*model_files("allennlp"))


def test_each_policy_maps_to_a_precision_and_dtype():
    assert Compute.from_policy("float32") == Compute("highest", jnp.float32) == Compute()
    assert Compute.from_policy("bfloat16") == Compute("default", jnp.bfloat16)
    assert Compute.from_policy("bfloat16").precision == jax.lax.Precision.DEFAULT
    assert Compute.from_policy("bfloat16").dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="one of float32, tf32, bfloat16; got 'fp16'"):
        Compute.from_policy("fp16")


def test_compute_is_validated_and_hashable():
    from elmo_jax.model.layout import Layout

    layout = Layout("rows", 20)
    assert Compute.from_policy("bfloat16", layout=layout) == Compute("default", "bfloat16", layout)
    assert hash(Compute(dtype="float32")) == hash(Compute())
    assert len({Compute(), Compute.from_policy("float32"), Compute(layout=layout)}) == 2
    assert Compute(layout=layout).resolved_layout() is layout and Compute().resolved_layout() is not None
    for bad, match in (({"precision": "fast"}, "unknown matmul precision"), ({"precision": 3}, "Precision"),
                       ({"dtype": jnp.int32}, "floating"), ({"dtype": "nope"}, "not a dtype"),
                       ({"layout": "rows"}, "Layout or None")):
        with pytest.raises(ValueError, match=match):
            Compute(**bad)


def test_tf32_is_refused_off_a_gpu_in_one_line():
    assert policy.check("tf32", backend="gpu") == "tf32"
    with pytest.raises(ValueError, match="GPU matmul mode; this backend is cpu"):
        policy.check("tf32", backend="cpu")


def test_training_defaults_to_bfloat16_on_accelerators_only():
    assert policy.default_for_training("cpu") == "float32"
    assert policy.default_for_training("gpu") == policy.default_for_training("tpu") == "bfloat16"


def test_embedder_takes_the_policy():
    from elmo_jax.extract.embedder import Embedder

    config, params = tiny_model()
    sents = [["a", "small", "test"], ["two"]]
    new = Embedder(config, params, precision="bfloat16").embed(sents)
    exact = Embedder(config, params).embed(sents)
    for a, c in zip(new, exact):
        assert a.dtype == np.float32
        assert np.abs(a - c).max() > 0  # bfloat16 matmuls did run
        np.testing.assert_allclose(a, c, atol=0.05 * np.abs(c).max())


def test_precision_is_the_one_name(capsys):
    """The deprecated ``dtype=`` / ``--dtype`` spellings are gone, not silently ignored."""
    from elmo_jax.extract.embedder import Embedder
    from elmo_jax.training.loop import RunSettings

    config, params = tiny_model()
    with pytest.raises(TypeError, match="dtype"):
        Embedder(config, params, dtype="bfloat16")
    with pytest.raises(TypeError, match="dtype"):
        RunSettings(run_dir="unused", dtype="bfloat16")
    with pytest.raises(ValueError, match="one of float32, tf32, bfloat16; got 'highest'"):
        Embedder(config, params, precision="highest")
    with pytest.raises(SystemExit):
        cli_main(["embed", "--options", "x.json", "--weights", "x.hdf5", "--input", "x", "--output", "y",
                  "--dtype", "bfloat16"])
    assert "unrecognized arguments: --dtype bfloat16" in capsys.readouterr().err


def test_flax_module_takes_the_policy():
    from elmo_jax import Elmo, batch_to_ids

    config, params = tiny_model()
    ids = batch_to_ids([["a", "b"]])
    outs = {}
    for p in ("float32", "bfloat16"):
        module = Elmo(config=config, precision=p, dropout=0.0)
        variables = module.init(jax.random.PRNGKey(0), ids, deterministic=True)
        from elmo_jax import with_bilm

        variables = with_bilm(variables, params)
        outs[p] = np.asarray(module.apply(variables, ids, deterministic=True)["elmo_representations"][0])
    assert np.abs(outs["float32"] - outs["bfloat16"]).max() > 0
    np.testing.assert_allclose(outs["bfloat16"], outs["float32"], atol=0.05 * np.abs(outs["float32"]).max())
