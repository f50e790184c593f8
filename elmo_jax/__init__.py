"""elmo_jax: ELMo in pure JAX, compatible with bilm-tf and AllenNLP weights."""

from elmo_jax.bilm import add_sentence_markers, bilm_apply, init as init_bilm
from elmo_jax.chars import Vocabulary, VocabError, batch_to_ids, token_to_ids
from elmo_jax.config import (PRESETS, CharCNNConfig, ConfigError, LSTMConfig, ModelConfig, Options,
                             TrainConfig, preset)
from elmo_jax.weights import WeightsError, load_hdf5, save_hdf5

__version__ = "0.1.0"

__all__ = [
    "PRESETS", "CharCNNConfig", "ConfigError", "LSTMConfig", "ModelConfig", "Options", "TrainConfig",
    "Vocabulary", "VocabError", "WeightsError", "add_sentence_markers", "batch_to_ids", "bilm_apply",
    "init_bilm", "load_hdf5", "preset", "save_hdf5", "token_to_ids",
]
