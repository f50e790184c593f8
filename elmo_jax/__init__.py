"""elmo_jax: ELMo in pure JAX, compatible with bilm-tf and AllenNLP weights."""

from elmo_jax.compat.hdf5 import WeightsError, load_hdf5, save_hdf5
from elmo_jax.config import PRESETS, CharCNNConfig, ConfigError, LSTMConfig, ModelConfig, Options, TrainConfig, preset
from elmo_jax.model.bilm import add_sentence_markers, bilm_apply
from elmo_jax.model.bilm import init as init_bilm
from elmo_jax.model.vocabulary import VocabError, Vocabulary, batch_to_ids, token_to_ids

__version__ = "0.1.0"

# Imported on first use (PEP 562), so that `import elmo_jax` does not import flax, the embedder
# or the model downloader: name -> the module that defines it.
_LAZY = {
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

__all__ = [  # noqa: PLE0604 - *_LAZY unpacks its keys, all str
    "PRESETS",
    "CharCNNConfig",
    "ConfigError",
    "LSTMConfig",
    "ModelConfig",
    "Options",
    "TrainConfig",
    "Vocabulary",
    "VocabError",
    "WeightsError",
    "add_sentence_markers",
    "batch_to_ids",
    "bilm_apply",
    "init_bilm",
    "load_hdf5",
    "preset",
    "save_hdf5",
    "token_to_ids",
    *_LAZY,
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
