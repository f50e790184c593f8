"""ELMo for downstream Flax models: the scalar mix and the ``Elmo`` layer, linen and NNX (``elmo``)."""
