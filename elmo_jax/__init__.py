"""elmo_jax: ELMo in pure JAX, compatible with bilm-tf and AllenNLP weights."""

import typing

if typing.TYPE_CHECKING:  # what type checkers and editors see; at run time, __getattr__ below
    from elmo_jax._util.runtime import enable_compile_cache, set_gpu_kernels
    from elmo_jax.compat.hdf5 import WeightsError, load_hdf5, save_hdf5
    from elmo_jax.config import (
        PRESETS,
        CharCNNConfig,
        ConfigError,
        LSTMConfig,
        ModelConfig,
        Options,
        TrainConfig,
        preset,
    )
    from elmo_jax.extract.embedder import Embedder
    from elmo_jax.model.bilm import add_sentence_markers, bilm_apply
    from elmo_jax.model.bilm import init as init_bilm
    from elmo_jax.model.vocabulary import VocabError, Vocabulary, batch_to_ids, token_to_ids
    from elmo_jax.modules.elmo import Elmo, ElmoNNX, ScalarMix, scalar_mix, with_bilm
    from elmo_jax.pretrained import load_pretrained

__version__ = "0.1.0"

# Every name is imported on first use (PEP 562), so that `import elmo_jax` imports neither jax nor
# h5py: the command line (`elmo_jax.cli`) sets its signal handlers first, and a signal during its
# second of imports is the command's one line, not a traceback (or a crash) out of jax's import.
# name -> the module that defines it (`:name` there, where it differs).
_LAZY = {
    "WeightsError": "elmo_jax.compat.hdf5",
    "load_hdf5": "elmo_jax.compat.hdf5",
    "save_hdf5": "elmo_jax.compat.hdf5",
    "PRESETS": "elmo_jax.config",
    "CharCNNConfig": "elmo_jax.config",
    "ConfigError": "elmo_jax.config",
    "LSTMConfig": "elmo_jax.config",
    "ModelConfig": "elmo_jax.config",
    "Options": "elmo_jax.config",
    "TrainConfig": "elmo_jax.config",
    "preset": "elmo_jax.config",
    "add_sentence_markers": "elmo_jax.model.bilm",
    "bilm_apply": "elmo_jax.model.bilm",
    "init_bilm": "elmo_jax.model.bilm:init",
    "Vocabulary": "elmo_jax.model.vocabulary",
    "VocabError": "elmo_jax.model.vocabulary",
    "batch_to_ids": "elmo_jax.model.vocabulary",
    "token_to_ids": "elmo_jax.model.vocabulary",
    "Embedder": "elmo_jax.extract.embedder",
    "Elmo": "elmo_jax.modules.elmo",
    "ElmoNNX": "elmo_jax.modules.elmo",
    "ScalarMix": "elmo_jax.modules.elmo",
    "scalar_mix": "elmo_jax.modules.elmo",
    "with_bilm": "elmo_jax.modules.elmo",
    "load_pretrained": "elmo_jax.pretrained",
    "enable_compile_cache": "elmo_jax._util.runtime",
    "set_gpu_kernels": "elmo_jax._util.runtime",
}

__all__ = [  # the same names as _LAZY (tests/test_toplevel.py), written out for linters
    "CharCNNConfig",
    "ConfigError",
    "Elmo",
    "ElmoNNX",
    "Embedder",
    "LSTMConfig",
    "ModelConfig",
    "Options",
    "PRESETS",
    "ScalarMix",
    "TrainConfig",
    "VocabError",
    "Vocabulary",
    "WeightsError",
    "add_sentence_markers",
    "batch_to_ids",
    "bilm_apply",
    "enable_compile_cache",
    "init_bilm",
    "load_hdf5",
    "load_pretrained",
    "preset",
    "save_hdf5",
    "scalar_mix",
    "set_gpu_kernels",
    "token_to_ids",
    "with_bilm",
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    module, _, attr = _LAZY[name].partition(":")
    value = getattr(importlib.import_module(module), attr or name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
