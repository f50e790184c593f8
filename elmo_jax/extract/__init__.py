"""ELMo vectors from a trained biLM: ``embedder.Embedder`` (on the host, ``packing``: how a job's
sentences are laid into rows and their outputs copied back) and its output files (``to_file``:
``embed_file``, a text file into hdf5, what ``elmo-jax embed`` runs; ``ShardedEmbeddings``, which
reads them back)."""

from elmo_jax.extract.to_file import EmbedFileOptions, EmbedFileResult, ShardedEmbeddings, embed_file

__all__ = ["EmbedFileOptions", "EmbedFileResult", "ShardedEmbeddings", "embed_file"]
