"""The precision policy (elmo_jax.policy): names, defaults, and where it is used."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import model_files

from elmo_jax import load_hdf5, policy
from elmo_jax.cli import main as cli_main
from elmo_jax.model.compute import Compute


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
    for bad, match in (
        ({"precision": "fast"}, "unknown matmul precision"),
        ({"precision": 3}, "Precision"),
        ({"dtype": jnp.int32}, "floating"),
        ({"dtype": "nope"}, "not a dtype"),
        ({"layout": "rows"}, "Layout or None"),
    ):
        with pytest.raises(ValueError, match=match):
            Compute(**bad)


def test_tf32_is_refused_off_a_gpu_in_one_line():
    assert policy.check("tf32", backend="gpu") == "tf32"
    with pytest.raises(ValueError, match="GPU matmul mode; this backend is cpu"):
        policy.check("tf32", backend="cpu")


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
        cli_main(
            [
                "embed",
                "--options",
                "x.json",
                "--weights",
                "x.hdf5",
                "--input",
                "x",
                "--output",
                "y",
                "--dtype",
                "bfloat16",
            ]
        )
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


class FakeDevice:
    """What ``policy.training_default`` reads of a jax device."""

    def __init__(self, platform, device_kind, compute_capability=None):
        self.platform, self.device_kind = platform, device_kind
        if compute_capability is not None:  # jax's CPU and TPU devices have no such attribute
            self.compute_capability = compute_capability


@pytest.mark.parametrize(
    "kind, cap",
    [
        ("NVIDIA A100-SXM4-80GB", "8.0"),
        ("NVIDIA H100 80GB HBM3", "9.0"),
        ("NVIDIA H200", "9.0"),
        ("NVIDIA L4", "8.9"),
        ("NVIDIA A10G", "8.6"),
    ],
)
def test_training_takes_bfloat16_from_compute_capability_8(kind, cap):
    assert policy.training_default(FakeDevice("gpu", kind, cap)) == (
        "bfloat16",
        f"{kind}, compute capability {cap}: native bfloat16",
    )


@pytest.mark.parametrize(
    "kind, cap", [("Tesla T4", "7.5"), ("Tesla V100-SXM2-16GB", "7.0"), ("Tesla P100-PCIE-16GB", "6.0")]
)
def test_training_takes_float32_on_gpus_without_bfloat16(kind, cap):
    assert policy.training_default(FakeDevice("gpu", kind, cap)) == (
        "float32",
        f"{kind}, compute capability {cap}: no native bfloat16, float32 is faster",
    )


@pytest.mark.parametrize(
    "kind, policy_name, cap",
    [
        ("NVIDIA H100 PCIe", "bfloat16", "9.0"),
        ("NVIDIA A100-PCIE-40GB", "bfloat16", "8.0"),
        ("Tesla T4", "float32", "7.5"),
        ("Tesla V100-PCIE-32GB", "float32", "7.0"),
        ("Tesla P100-PCIE-16GB", "float32", "6.0"),
    ],
)
def test_a_gpu_without_the_attribute_is_told_by_its_name(kind, policy_name, cap):
    name, reason = policy.training_default(FakeDevice("gpu", kind))
    assert name == policy_name
    assert reason.startswith(f"{kind}, compute capability {cap} (from its name): ")


def test_an_unknown_gpu_gets_float32_and_says_why():
    name, reason = policy.training_default(FakeDevice("gpu", "Some Future Card"))
    assert name == "float32"
    assert reason == (
        "Some Future Card, compute capability unknown: float32, as bfloat16 is native only "
        "from compute capability 8.0 on"
    )


def test_tpus_and_cpus():
    assert policy.training_default(FakeDevice("tpu", "TPU v5 lite")) == ("bfloat16", "TPU v5 lite: native bfloat16")
    assert policy.training_default(FakeDevice("tpu", "")) == ("bfloat16", "TPU: native bfloat16")
    assert policy.training_default(FakeDevice("cpu", "cpu")) == ("float32", "CPU: bfloat16 matmuls are slower here")
    # This process's own device (a CPU in the test suite), as the training loop asks.
    assert policy.training_default() == policy.training_default(jax.devices()[0])


def test_the_capability_decides_not_the_name():
    """Negative control: the reported capability wins over the name table, both ways."""
    assert policy.training_default(FakeDevice("gpu", "Tesla T4", "8.0"))[0] == "bfloat16"
    assert policy.training_default(FakeDevice("gpu", "NVIDIA H100 80GB HBM3", "7.5"))[0] == "float32"
    assert policy.training_default(FakeDevice("gpu", "NVIDIA H100 80GB HBM3", "7.5")) != (
        "bfloat16",
        "NVIDIA H100 80GB HBM3, compute capability 7.5: native bfloat16",
    )
