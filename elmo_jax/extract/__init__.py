"""ELMo vectors from a trained biLM: ``embedder.Embedder`` and its output files."""
