"""ELMo vectors from a trained biLM: ``embedder.Embedder`` and its output files (``to_file.embed_file``:
a text file into hdf5, what ``elmo-jax embed`` runs)."""

from elmo_jax.extract.to_file import EmbedFileOptions, EmbedFileResult, embed_file

__all__ = ["EmbedFileOptions", "EmbedFileResult", "embed_file"]
