"""``import elmo_jax`` is light, and its lazily imported names resolve (PEP 562 ``__getattr__``)."""

import json
import pathlib
import subprocess
import sys

import pytest

import elmo_jax

HEAVY = (
    "jax",
    "h5py",
    "numpy",
    "orbax",
    "flax",
    "elmo_jax.extract.embedder",
    "elmo_jax.modules.elmo",
    "elmo_jax.pretrained",
)
LAZY = (
    "bilm_apply",
    "init_bilm",
    "WeightsError",
    "Embedder",
    "Elmo",
    "ElmoNNX",
    "ScalarMix",
    "scalar_mix",
    "with_bilm",
    "load_pretrained",
    "enable_compile_cache",
    "Compute",
    "embed_file",
    "EmbedFileOptions",
    "ShardedEmbeddings",
    "fetch",
    "TextFiles",
    "tokenize",
    "build_vocab",
    "evaluate",
    "pretrain",
    "RunSettings",
    "load_run",
    "export_run",
)
HAS_PRETRAINED = (pathlib.Path(elmo_jax.__file__).parent / "pretrained" / "registry.py").exists()


@pytest.mark.parametrize("module", ["elmo_jax", "elmo_jax.cli"])
def test_import_elmo_jax_or_its_command_line_imports_nothing_heavy(module):
    """Not even jax: the command line sets its signal handlers before jax's second of imports
    (tests/test_cli.py::test_a_signal_while_the_program_imports_jax_is_its_one_line_and_exit_code)."""
    code = f"import sys, json, {module}; print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []


def test_all_is_every_lazy_name():
    assert sorted(elmo_jax.__all__) == sorted(elmo_jax._LAZY)


@pytest.mark.parametrize("name", LAZY)
def test_every_lazy_name_resolves_and_is_listed(name):
    if name == "load_pretrained" and not HAS_PRETRAINED:
        pytest.skip("elmo_jax/pretrained/registry.py is not written yet")
    value = getattr(elmo_jax, name)
    module = {
        "Embedder": "elmo_jax.extract.embedder",
        "load_pretrained": "elmo_jax.pretrained",
        "enable_compile_cache": "elmo_jax._util.runtime",
        "bilm_apply": "elmo_jax.model.bilm",
        "init_bilm": "elmo_jax.model.bilm",
        "WeightsError": "elmo_jax.compat.hdf5",
        "Compute": "elmo_jax.model.compute",
        "embed_file": "elmo_jax.extract.to_file",
        "EmbedFileOptions": "elmo_jax.extract.to_file",
        "ShardedEmbeddings": "elmo_jax.extract.to_file",
        "fetch": "elmo_jax.pretrained.registry",
        "TextFiles": "elmo_jax.text.sources",
        "tokenize": "elmo_jax.text.tokenize",
        "build_vocab": "elmo_jax.text.vocab",
        "evaluate": "elmo_jax.training.evaluate",
        "pretrain": "elmo_jax.training.loop",
        "RunSettings": "elmo_jax.training.loop",
        "load_run": "elmo_jax.training.run_dir",
        "export_run": "elmo_jax.training.run_dir",
    }.get(name, "elmo_jax.modules.elmo")
    assert value is getattr(sys.modules[module], {"init_bilm": "init"}.get(name, name))
    assert name in elmo_jax.__all__ and name in dir(elmo_jax)
    assert len(set(elmo_jax.__all__)) == len(elmo_jax.__all__)


def test_an_unknown_name_is_the_usual_attribute_error():
    with pytest.raises(AttributeError, match=r"^module 'elmo_jax' has no attribute 'nope'$"):
        elmo_jax.nope  # noqa: B018
    assert not hasattr(elmo_jax, "Embeder")


def test_star_import_gives_every_name_in_all():
    ns = {}
    exec("from elmo_jax import *", ns)
    missing = [n for n in elmo_jax.__all__ if n not in ns and not (n == "load_pretrained" and not HAS_PRETRAINED)]
    assert not missing
