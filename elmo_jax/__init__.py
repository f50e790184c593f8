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
    from elmo_jax.extract.to_file import EmbedFileOptions, EmbedFileResult, ShardedEmbeddings, embed_file
    from elmo_jax.model.bilm import add_sentence_markers, bilm_apply
    from elmo_jax.model.bilm import init as init_bilm
    from elmo_jax.model.compute import Compute
    from elmo_jax.model.vocabulary import VocabError, Vocabulary, batch_to_ids, token_to_ids
    from elmo_jax.modules.elmo import FROZEN_COLLECTION, Elmo, ElmoNNX, ScalarMix, scalar_mix, with_bilm
    from elmo_jax.pretrained import fetch, list_models, load_pretrained
    from elmo_jax.text.sources import DataError, Lines, TextFiles, open_source
    from elmo_jax.text.tokenize import tokenize, tokenize_text
    from elmo_jax.text.vocab import build_vocab, count_tokens, write_vocab
    from elmo_jax.training.evaluate import evaluate
    from elmo_jax.training.hooks import Stopped
    from elmo_jax.training.loop import RunSettings, options_for_vocab, pretrain
    from elmo_jax.training.run_dir import ExportResult, export_run, load_run

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
    "FROZEN_COLLECTION": "elmo_jax.modules.elmo",
    "ElmoNNX": "elmo_jax.modules.elmo",
    "ScalarMix": "elmo_jax.modules.elmo",
    "scalar_mix": "elmo_jax.modules.elmo",
    "with_bilm": "elmo_jax.modules.elmo",
    "Compute": "elmo_jax.model.compute",
    "EmbedFileOptions": "elmo_jax.extract.to_file",
    "EmbedFileResult": "elmo_jax.extract.to_file",
    "ShardedEmbeddings": "elmo_jax.extract.to_file",
    "embed_file": "elmo_jax.extract.to_file",
    "load_pretrained": "elmo_jax.pretrained",
    "fetch": "elmo_jax.pretrained",
    "list_models": "elmo_jax.pretrained",
    "DataError": "elmo_jax.text.sources",
    "Lines": "elmo_jax.text.sources",
    "TextFiles": "elmo_jax.text.sources",
    "open_source": "elmo_jax.text.sources",
    "tokenize": "elmo_jax.text.tokenize",
    "tokenize_text": "elmo_jax.text.tokenize",
    "build_vocab": "elmo_jax.text.vocab",
    "count_tokens": "elmo_jax.text.vocab",
    "write_vocab": "elmo_jax.text.vocab",
    "evaluate": "elmo_jax.training.evaluate",
    "Stopped": "elmo_jax.training.hooks",
    "RunSettings": "elmo_jax.training.loop",
    "options_for_vocab": "elmo_jax.training.loop",
    "pretrain": "elmo_jax.training.loop",
    "ExportResult": "elmo_jax.training.run_dir",
    "export_run": "elmo_jax.training.run_dir",
    "load_run": "elmo_jax.training.run_dir",
    "enable_compile_cache": "elmo_jax._util.runtime",
    "set_gpu_kernels": "elmo_jax._util.runtime",
}

__all__ = [  # the same names as _LAZY (tests/test_toplevel.py), written out for linters
    "CharCNNConfig",
    "Compute",
    "ConfigError",
    "DataError",
    "Elmo",
    "ElmoNNX",
    "EmbedFileOptions",
    "EmbedFileResult",
    "Embedder",
    "ExportResult",
    "FROZEN_COLLECTION",
    "LSTMConfig",
    "Lines",
    "ModelConfig",
    "Options",
    "PRESETS",
    "RunSettings",
    "ScalarMix",
    "ShardedEmbeddings",
    "Stopped",
    "TextFiles",
    "TrainConfig",
    "VocabError",
    "Vocabulary",
    "WeightsError",
    "add_sentence_markers",
    "batch_to_ids",
    "bilm_apply",
    "build_vocab",
    "count_tokens",
    "embed_file",
    "enable_compile_cache",
    "evaluate",
    "export_run",
    "fetch",
    "init_bilm",
    "list_models",
    "load_hdf5",
    "load_pretrained",
    "load_run",
    "open_source",
    "options_for_vocab",
    "preset",
    "pretrain",
    "save_hdf5",
    "scalar_mix",
    "set_gpu_kernels",
    "token_to_ids",
    "tokenize",
    "tokenize_text",
    "with_bilm",
    "write_vocab",
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
