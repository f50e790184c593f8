"""elmo_jax: ELMo in pure JAX, compatible with bilm-tf and AllenNLP weights."""

from elmo_jax.bilm import add_sentence_markers, bilm_apply, init as init_bilm
from elmo_jax.chars import Vocabulary, VocabError, batch_to_ids, token_to_ids
from elmo_jax.config import (PRESETS, CharCNNConfig, ConfigError, LSTMConfig, ModelConfig, Options,
                             TrainConfig, preset)
from elmo_jax.weights import WeightsError, load_hdf5, save_hdf5

__version__ = "0.1.0"

# Imported on first use (PEP 562), so that `import elmo_jax` does not import flax, the embedder
# or the model downloader: name -> the module that defines it.
_LAZY = {
    "Embedder": "elmo_jax.embed",
    "Elmo": "elmo_jax.flax_modules",
    "ElmoNNX": "elmo_jax.flax_modules",
    "ScalarMix": "elmo_jax.flax_modules",
    "scalar_mix": "elmo_jax.flax_modules",
    "with_bilm": "elmo_jax.flax_modules",
    "load_pretrained": "elmo_jax.pretrained",
    "enable_compile_cache": "elmo_jax.runtime",
}

__all__ = [
    "PRESETS", "CharCNNConfig", "ConfigError", "LSTMConfig", "ModelConfig", "Options", "TrainConfig",
    "Vocabulary", "VocabError", "WeightsError", "add_sentence_markers", "batch_to_ids", "bilm_apply",
    "init_bilm", "load_hdf5", "preset", "save_hdf5", "token_to_ids", *_LAZY,
]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
