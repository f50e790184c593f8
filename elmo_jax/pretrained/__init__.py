"""AllenNLP's released ELMo models: the registry of their files and the download cache (``registry``).

from elmo_jax.pretrained import load_pretrained
config, params = load_pretrained("original")
"""

from elmo_jax.pretrained.registry import (
    BASE_URL,
    DEFAULT_FILES,
    MODELS,
    ROLES,
    DownloadFailed,
    FileStatus,
    PretrainedError,
    PretrainedModel,
    RemoteFile,
    cache_root,
    cache_status,
    fetch,
    get_model,
    list_models,
    load_pretrained,
    offline,
    source_of,
    verify,
)

__all__ = [
    "BASE_URL",
    "DEFAULT_FILES",
    "DownloadFailed",
    "MODELS",
    "ROLES",
    "FileStatus",
    "PretrainedError",
    "PretrainedModel",
    "RemoteFile",
    "cache_root",
    "cache_status",
    "fetch",
    "get_model",
    "list_models",
    "load_pretrained",
    "offline",
    "source_of",
    "verify",
]
