"""Pretraining: the sharded train step (``step``), its loop over a run directory (``loop``), the
batcher (``batches``) and host-side prefetch (``prefetch``), the sampled and row-split softmax
(``softmax``, ``sharded_softmax``), checkpoints (``checkpoint``), reading and exporting a run
directory (``run_dir``), held-out perplexity (``evaluate``) and starting from released weights
(``warmstart``)."""
