"""ELMo as Flax modules: the scalar mix (bilm-tf's ``weight_layers``, AllenNLP's ``ScalarMix``)
and an ``Elmo`` layer (linen and NNX).

``Elmo`` turns character ids (or precomputed biLM layers) into one or more ELMo representations,
each a learned scalar mix of the biLM layers followed by dropout, ready to feed a downstream model.

Frozen means frozen. With ``trainable_bilm=False`` (the default) the biLM weights are not in the
``"params"`` collection (linen: they are the ``"frozen_bilm"`` collection) and are not an
``nnx.Param`` (NNX): an optimizer over the params, weight decay included, cannot move them,
gradients never reach them (``jax.lax.stop_gradient``), and a checkpoint of the downstream params
does not carry them. With ``trainable_bilm=True`` they are ordinary params under ``"bilm"``.

The linen ``Elmo`` holds no arrays: as for any pretrained Flax submodule, its weights go into the
variables that ``init`` returns (``with_bilm``), which a jitted function takes as arguments.

The two scalar-mix conventions (``convention=``):

* ``"allennlp"`` (default, AllenNLP's ``Elmo``): the mix runs over the layers *with* ``<S>``/``</S>``
  (with layer norm they enter the statistics, epsilon 1e-13); the markers are removed afterwards.
* ``"bilm_tf"`` (bilm-tf's ``weight_layers``): the mix runs over the sentence tokens only
  (epsilon 1e-12).

Without layer norm the two give the same numbers. With it they differ, the more the larger the
markers' share of the batch's positions (short sentences), and either way a layer-normed mix
depends on the rest of the batch (one mean and variance per layer per batch).

AllenNLP's ``keep_sentence_boundaries`` and ``scalar_mix_parameters`` (a fixed mix, not trained)
are attributes of the same names.

Example: a tagger over a frozen ELMo (linen)::

    import flax.linen as nn
    import jax, jax.numpy as jnp, optax
    from elmo_jax import batch_to_ids
    from elmo_jax.modules.elmo import FROZEN_COLLECTION, Elmo, with_bilm

    class Tagger(nn.Module):
        elmo: Elmo
        n_tags: int

        @nn.compact
        def __call__(self, char_ids, *, deterministic):
            out = self.elmo(char_ids, deterministic=deterministic)
            logits = nn.Dense(self.n_tags)(out["elmo_representations"][0])
            return logits, out["mask"]

    elmo, bilm = Elmo.from_hdf5("options.json", "weights.hdf5", dropout=0.5)  # module, weights
    model = Tagger(elmo, n_tags=17)
    char_ids = batch_to_ids([["The", "cat", "sat"], ["Hi"]])            # [B, T, 50]
    tags = jnp.array([[1, 2, 3], [4, 0, 0]])
    variables = model.init(jax.random.PRNGKey(0), char_ids, deterministic=True)  # random biLM
    variables = with_bilm(variables, bilm)                               # the pretrained one
    params = variables["params"]           # scalar mix + Dense only: no biLM in here
    frozen = {FROZEN_COLLECTION: variables[FROZEN_COLLECTION]}           # the biLM weights
    tx = optax.adamw(1e-3, weight_decay=0.01)
    opt_state = tx.init(params)

    @jax.jit
    def train_step(params, opt_state, frozen, char_ids, tags, key):
        def loss_fn(params):
            logits, mask = model.apply({"params": params, **frozen}, char_ids,
                                       deterministic=False, rngs={"dropout": key})
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tags)
            return jnp.sum(ce * mask) / jnp.maximum(mask.sum(), 1)
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    params, opt_state, loss = train_step(params, opt_state, frozen, char_ids, tags, jax.random.PRNGKey(1))
    # Save `params` (and `opt_state`): the biLM comes from the weight files again at load time.

``frozen`` is an argument of the jitted step, so the biLM weights reach the compiled program as
arguments (closing over them instead would compile them in as constants: on the order of 10 s of
extra compile time per input shape, on a CPU, for a released ~90M-parameter model). The module
itself holds no arrays, so ``nn.jit(Tagger, static_argnames="deterministic")`` works too. With
``trainable_bilm=True``, ``with_bilm`` puts the weights into ``params`` instead, and there is no
``"frozen_bilm"`` collection (pass ``frozen={}``).

The same with NNX::

    from flax import nnx
    from elmo_jax.modules.elmo import ElmoNNX

    class TaggerNNX(nnx.Module):
        def __init__(self, elmo, n_tags, rngs):
            self.elmo = elmo
            self.out = nnx.Linear(elmo.config.output_dim, n_tags, rngs=rngs)

        def __call__(self, char_ids, *, deterministic=None):
            out = self.elmo(char_ids, deterministic=deterministic)
            return self.out(out["elmo_representations"][0]), out["mask"]

    model = TaggerNNX(ElmoNNX.from_hdf5("options.json", "weights.hdf5", rngs=nnx.Rngs(0)), 17,
                      nnx.Rngs(1))
    optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.01), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, char_ids, tags):
        def loss_fn(model):
            logits, mask = model(char_ids, deterministic=False)
            ce = optax.softmax_cross_entropy_with_integer_labels(logits, tags)
            return jnp.sum(ce * mask) / jnp.maximum(mask.sum(), 1)
        loss, grads = nnx.value_and_grad(loss_fn)(model)   # w.r.t. nnx.Param: no biLM
        optimizer.update(model, grads)
        return loss

    # nnx.state(model, nnx.Param) is what to checkpoint; the frozen biLM is a FrozenBiLM variable.

The module runs the biLM stateless (each sentence's vectors depend on that sentence only).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from flax import nnx

from elmo_jax import policy
from elmo_jax.config import ModelConfig
from elmo_jax.model import bilm as _bilm
from elmo_jax.model.compute import Compute

CONVENTIONS = ("allennlp", "bilm_tf")
LAYER_NORM_EPSILON = {"allennlp": 1e-13, "bilm_tf": 1e-12}
FROZEN_COLLECTION = "frozen_bilm"

__all__ = [
    "CONVENTIONS",
    "Elmo",
    "ElmoNNX",
    "FROZEN_COLLECTION",
    "FrozenBiLM",
    "ScalarMix",
    "ScalarMixNNX",
    "l2_penalty",
    "remove_sentence_markers",
    "scalar_mix",
    "with_bilm",
]


def _check_convention(convention: str) -> None:
    if convention not in CONVENTIONS:
        raise ValueError(f"convention must be one of {CONVENTIONS}, found {convention!r}")


def _check_keep(keep: Any, convention: str, name: str) -> None:
    if keep and convention != "allennlp":
        raise ValueError(f"{name} needs convention 'allennlp': bilm_tf's mix runs over the sentence tokens only")


def _fixed_mix(values: Any, n_layers: int) -> tuple[float, ...] | None:
    """``scalar_mix_parameters`` as a tuple of floats (hashable, for ``nn.jit``), or one line for
    values that are not ``n_layers`` finite numbers."""
    if values is None:
        return None
    ok = isinstance(values, (list, tuple)) and all(
        isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v) for v in values
    )
    if not ok or len(values) != n_layers:
        raise ValueError(
            f"scalar_mix_parameters must be {n_layers} finite numbers (the pre-softmax weight of each biLM "
            f"layer), got {values!r}"
        )
    return tuple(float(v) for v in values)


def _check_config(config: Any, call: str) -> None:
    """One line for a config that is not a ``ModelConfig`` (the arguments in another order), naming
    how the module is made (``call``)."""
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config is a {type(config).__name__}; expected a ModelConfig: {call}")


def _check_settings(num_output_representations: Any, dropout: Any) -> None:
    """One line for a count or a rate of the wrong type or out of range, as the module is made
    (not deep in a trace). numpy's integers and floats are taken (a sweep's values)."""
    n = num_output_representations
    if isinstance(n, bool) or not isinstance(n, numbers.Integral):
        # Elmo(config, params): the weights land here (they go in with with_bilm, after init).
        weights = " (the biLM weights go in with with_bilm, after init)" if isinstance(n, Mapping) else ""
        raise TypeError(f"num_output_representations must be an int of at least 1, got {_brief(n)}{weights}")
    if n < 1:
        raise ValueError(f"num_output_representations must be an int of at least 1, got {n!r}")
    if isinstance(dropout, bool) or not isinstance(dropout, numbers.Real):
        raise TypeError(f"dropout must be a rate from 0 up to (not including) 1, got {_brief(dropout)}")
    if not 0.0 <= float(dropout) < 1.0:
        raise ValueError(f"dropout must be a rate from 0 up to (not including) 1, got {dropout!r}")


def _brief(value: Any) -> str:
    return f"a {type(value).__name__}" if isinstance(value, Mapping) else repr(value)


def _masked_layer_norm(layers: jax.Array, mask: jax.Array, epsilon: float) -> jax.Array:
    """Each layer ``[B, T, D]`` normalised with one mean and one variance over its unmasked elements,
    in float32 at least: in float16 (precomputed layers stored small) the count of a batch's elements
    passes float16's largest number, 65504, and the epsilon rounds to 0."""
    layers = layers.astype(jnp.promote_types(layers.dtype, jnp.float32))
    m = mask[None, :, :, None]
    count = jnp.maximum(jnp.sum(mask) * layers.shape[-1], 1).astype(layers.dtype)
    mean = jnp.sum(jnp.where(m, layers, 0.0), axis=(1, 2, 3), keepdims=True) / count
    var = jnp.sum(jnp.where(m, jnp.square(layers - mean), 0.0), axis=(1, 2, 3), keepdims=True) / count
    return (layers - mean) / jnp.sqrt(var + epsilon)


def remove_sentence_markers(x: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``[B, T, ...]`` with ``<S>`` at 0 and each row's ``</S>`` at ``length + 1`` -> ``[B, T-2, ...]``.

    Row ``b`` (``mask[b].sum() == n + 2``) keeps its tokens ``1..n`` at ``0..n-1``; everything after
    is exactly 0. Returns the new ``x`` and its mask ``[B, T-2]`` (AllenNLP's
    ``remove_sentence_boundaries``; a row of markers only becomes all padding).
    """
    mask = mask.astype(bool)
    lengths = jnp.maximum(jnp.sum(mask, axis=1) - 2, 0)
    new_mask = jnp.arange(x.shape[1] - 2)[None, :] < lengths[:, None]
    # Dropping column 0 moves row b's </S> from n+1 to n, where the new mask zeroes it.
    body = x[:, 1:-1]
    keep = new_mask.reshape(new_mask.shape + (1,) * (x.ndim - 2))
    return jnp.where(keep, body, jnp.zeros((), body.dtype)), new_mask


def scalar_mix(
    layers: jax.Array,
    mask: jax.Array,
    weights: jax.Array,
    gamma: jax.Array,
    layer_norm: bool = False,
    convention: str = "allennlp",
    *,
    keep_sentence_markers: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """``gamma * sum_j softmax(weights)_j * norm_j(layers[j])``, then the convention's marker handling.

    Args:
      layers: ``[L+1, B, T, D]`` biLM layers. For ``"allennlp"`` they include ``<S>``/``</S>``
        (``bilm_apply(..., keep_sentence_markers=True)``); for ``"bilm_tf"`` they do not.
      mask: ``[B, T]`` (bool or 0/1) for those positions, markers included for ``"allennlp"``.
      weights: ``[L+1]`` pre-softmax mixing weights.
      gamma: scalar scale.
      layer_norm: normalise each layer first with one mean and one variance over all its unmasked
        elements of the batch (over B, T and D), epsilon 1e-13 (allennlp) or 1e-12 (bilm_tf).
      convention: ``"allennlp"`` (mix with the markers, then remove them) or ``"bilm_tf"``.
      keep_sentence_markers: ``"allennlp"`` only: keep the markers' positions in the output
        (AllenNLP's ``keep_sentence_boundaries``).

    Returns:
      ``(mixed [B, T', D], mask [B, T'])`` with ``T' = T - 2`` for ``"allennlp"`` (``T`` when
      the markers are kept) and ``T`` for ``"bilm_tf"``. Masked positions are exactly 0.
    """
    _check_convention(convention)
    _check_keep(keep_sentence_markers, convention, "keep_sentence_markers")
    layers = jnp.asarray(layers)
    mask = jnp.asarray(mask).astype(bool)
    if layers.ndim != 4 or layers.shape[1:3] != mask.shape:
        raise ValueError(f"layers must be [L+1, B, T, D] and mask [B, T]; got {layers.shape} and {mask.shape}")
    weights = jnp.asarray(weights)
    if weights.shape != (layers.shape[0],):
        raise ValueError(f"weights must have shape ({layers.shape[0]},) (one per layer), got {weights.shape}")
    if convention == "allennlp" and layers.shape[2] < 2:
        raise ValueError("the allennlp convention needs layers with <S>/</S> (time axis of at least 2)")
    if layer_norm:
        layers = _masked_layer_norm(layers, mask, LAYER_NORM_EPSILON[convention])
    s = jax.nn.softmax(weights)
    mixed = jnp.asarray(gamma) * jnp.sum(s[:, None, None, None] * layers, axis=0)
    if convention == "allennlp" and not keep_sentence_markers:
        return remove_sentence_markers(mixed, mask)
    return jnp.where(mask[:, :, None], mixed, jnp.zeros((), mixed.dtype)), mask


def l2_penalty(weights: jax.Array, coef: float) -> jax.Array:
    """bilm-tf's regulariser on the pre-softmax mixing weights: ``coef * sum(w^2)``."""
    return coef * jnp.sum(jnp.square(jnp.asarray(weights)))


def _plain(tree: Any) -> Any:
    """Dicts and lists of jax arrays (linen freezes dataclass fields into FrozenDicts and tuples)."""
    if isinstance(tree, Mapping):
        return {k: _plain(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_plain(v) for v in tree]
    return jnp.asarray(tree)


def _split_inputs(char_ids, layers, mask):
    if (char_ids is None) == (layers is None):
        which = "not both" if char_ids is not None else "neither was given"
        raise ValueError(f"pass either char_ids [B, T, C] or precomputed layers (with their mask): {which}")
    if layers is not None and mask is None:
        raise ValueError("precomputed layers need their mask")
    if char_ids is not None and mask is not None:  # it would be ignored: the ids say where tokens are
        raise ValueError("mask goes with precomputed layers; with char_ids the mask comes from the ids")


def _load_checkpoint(run_dir, step):
    from elmo_jax.training.run_dir import read_bilm  # orbax and the training code: imported only when needed

    options, params, _ = read_bilm(run_dir, step)
    return options.model, params["bilm"]


def _load_hdf5(options, weights):
    from elmo_jax.compat.hdf5 import load_hdf5

    return load_hdf5(options, weights)


def _load_pretrained(name, cache_dir, sha256):
    from elmo_jax.pretrained.registry import load_pretrained  # the downloader: imported only when needed

    return load_pretrained(name, cache_dir=cache_dir, sha256=sha256)


# --------------------------------------------------------------------------------------- linen


class ScalarMix(nn.Module):
    """One scalar mix: params ``weights`` ``[n_layers]`` (init 0) and ``gamma`` (init 1); with
    ``fixed`` (pre-softmax weights), no params: those weights and a gamma of 1, as AllenNLP's
    ``ScalarMix(initial_scalar_parameters=..., trainable=False)``."""

    n_layers: int
    layer_norm: bool = False
    convention: str = "allennlp"
    keep_sentence_markers: bool = False
    fixed: tuple[float, ...] | None = None

    @nn.compact
    def __call__(self, layers: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.fixed is not None:
            return _mix(self, layers, mask)
        weights = self.param("weights", nn.initializers.zeros, (self.n_layers,), jnp.float32)
        gamma = self.param("gamma", nn.initializers.ones, (), jnp.float32)
        return _mix(self, layers, mask, weights, gamma)


def _mix(mix: Any, layers: jax.Array, mask: jax.Array, weights: Any = None, gamma: Any = None):
    """``scalar_mix`` with a mix module's settings (linen or NNX): its ``fixed`` weights and a gamma
    of 1 where it has them, else ``weights`` and ``gamma``."""
    if mix.fixed is not None:
        weights, gamma = jnp.asarray(mix.fixed, jnp.float32), jnp.float32(1.0)
    return scalar_mix(
        layers, mask, weights, gamma, mix.layer_norm, mix.convention, keep_sentence_markers=mix.keep_sentence_markers
    )


def _layers_from_inputs(module, weights, char_ids, layers, mask):
    """The biLM layers and mask an Elmo module mixes: run the biLM on char ids, or take them given."""
    if char_ids is not None:
        if weights is None:
            raise ValueError(f"{type(module).__name__} was built without bilm_params: pass precomputed layers and mask")
        layers, mask, _ = _bilm.bilm_apply(
            weights,
            module.config,
            char_ids,  # a host array as it is: bilm_apply checks its values there
            None,
            keep_sentence_markers=module.convention == "allennlp",
            compute=Compute.from_policy(module.precision),
        )
    n_layers = module.config.n_output_layers
    if layers.shape[0] != n_layers:
        raise ValueError(f"expected {n_layers} biLM layers, got layers of shape {layers.shape}")
    return layers, mask


class Elmo(nn.Module):
    """ELMo representations for a downstream linen model (AllenNLP's ``Elmo``).

    Attributes:
      config: the biLM's ``ModelConfig``.
      num_output_representations: how many mixes (each its own ``scalar_mix_{k}`` and dropout).
      dropout: dropout rate on each representation (rng stream ``"dropout"``).
      do_layer_norm: layer-normalise each biLM layer before mixing (see ``scalar_mix``).
      trainable_bilm: False: the biLM weights are the variable ``"bilm"`` of the ``"frozen_bilm"``
        collection, read through ``stop_gradient``. True: they are ``params["bilm"]``.
      convention: ``"allennlp"`` or ``"bilm_tf"`` (module docstring).
      precision: ``"float32"`` (default), ``"tf32"`` or ``"bfloat16"`` matmuls in the biLM
        (``elmo_jax.policy``).
      keep_sentence_boundaries: keep ``<S>``/``</S>`` in the representations and the mask
        (``[B, T + 2, D]``; ``"allennlp"`` convention only), as AllenNLP's option of that name.
      scalar_mix_parameters: fixed pre-softmax mixing weights, one per biLM layer, and a gamma of
        1, not trained (no ``scalar_mix_{k}`` params), as AllenNLP's option of that name:
        ``(0, 0, 1)`` leans on the top layer, ``(-9e10, 1, -9e10)`` takes the first LSTM layer alone.

    The module holds no arrays (it is hashable, so ``nn.jit`` works): the biLM weights are
    variables. ``init`` draws a random biLM; ``with_bilm(variables, bilm_params)`` puts the
    pretrained one in its place (``from_hdf5``/``from_checkpoint`` return the module and its
    weights). Only char-id inputs need a biLM: a model fed precomputed layers declares none.

    ``__call__(char_ids=None, layers=None, mask=None, *, deterministic)``: ``char_ids [B, T, C]``
    from ``batch_to_ids``, or precomputed biLM ``layers [L+1, B, T'', D]`` with ``mask [B, T'']``
    (with ``<S>``/``</S>``, ``T'' = T + 2``, for ``"allennlp"``; without for ``"bilm_tf"``).
    Returns ``{"elmo_representations": [num_output_representations x [B, T, D]], "mask": [B, T]}``.
    """

    config: ModelConfig
    num_output_representations: int = 1
    dropout: float = 0.5
    do_layer_norm: bool = False
    trainable_bilm: bool = False
    convention: str = "allennlp"
    precision: str = "float32"
    keep_sentence_boundaries: bool = False
    scalar_mix_parameters: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        # Checked first: weights given in its place would be said to be a wrong num_output_representations.
        _check_config(self.config, "Elmo(config), the biLM weights put in with with_bilm after init")
        _check_settings(self.num_output_representations, self.dropout)
        _check_convention(self.convention)
        _check_keep(self.keep_sentence_boundaries, self.convention, "keep_sentence_boundaries")
        # A list given becomes a tuple: the module stays hashable (nn.jit).
        object.__setattr__(
            self, "scalar_mix_parameters", _fixed_mix(self.scalar_mix_parameters, self.config.n_output_layers)
        )
        policy.check(self.precision)  # as the module is made, not at its first init
        super().__post_init__()

    @classmethod
    def from_hdf5(cls, options, weights, **kwargs) -> tuple[Elmo, dict]:
        """``(module, bilm_params)`` from bilm-tf/AllenNLP files (``options.json``, ``weights.hdf5``)."""
        config, params = _load_hdf5(options, weights)
        return cls(config=config, **kwargs), _plain(params)

    @classmethod
    def from_checkpoint(cls, run_dir, step=None, **kwargs) -> tuple[Elmo, dict]:
        """``(module, bilm_params)`` from a pretraining run directory's newest (or given) checkpoint."""
        config, params = _load_checkpoint(run_dir, step)
        return cls(config=config, **kwargs), _plain(params)

    @classmethod
    def from_pretrained(cls, name, *, cache_dir=None, sha256=None, **kwargs) -> tuple[Elmo, dict]:
        """``(module, bilm_params)`` of a released model (``elmo_jax.pretrained``: ``"original"``, ...),
        downloaded once into the cache (``cache_dir``, ``sha256``: as for ``registry.fetch``)."""
        config, params = _load_pretrained(name, cache_dir, sha256)
        return cls(config=config, **kwargs), _plain(params)

    def _bilm_weights(self):
        def random_bilm(rng):  # a placeholder of the right shapes until with_bilm replaces it
            return _bilm.init(rng, self.config)

        if self.trainable_bilm:
            return self.param("bilm", random_bilm)
        if not (self.has_variable(FROZEN_COLLECTION, "bilm") or self.is_mutable_collection(FROZEN_COLLECTION)):
            raise ValueError(
                f"Elmo {'/'.join(self.path) or '(top)'} has no biLM: pass the {FROZEN_COLLECTION!r} "
                "collection (init, then with_bilm) to apply"
            )
        frozen = self.variable(FROZEN_COLLECTION, "bilm", lambda: random_bilm(self.make_rng("params")))
        return jax.lax.stop_gradient(frozen.value)

    @nn.compact
    def __call__(self, char_ids=None, layers=None, mask=None, *, deterministic: bool):
        _check_convention(self.convention)
        _split_inputs(char_ids, layers, mask)
        weights = self._bilm_weights() if char_ids is not None else None
        layers, mask = _layers_from_inputs(self, weights, char_ids, layers, mask)
        n_layers = self.config.n_output_layers
        reps, out_mask = [], None
        for k in range(self.num_output_representations):
            mix = ScalarMix(
                n_layers,
                self.do_layer_norm,
                self.convention,
                self.keep_sentence_boundaries,
                self.scalar_mix_parameters,
                name=f"scalar_mix_{k}",
            )
            mixed, out_mask = mix(layers, mask)
            reps.append(nn.Dropout(self.dropout, name=f"dropout_{k}")(mixed, deterministic=deterministic))
        return {"elmo_representations": reps, "mask": out_mask}


def with_bilm(variables: Mapping, bilm_params: Any, *, at: str | Sequence[str] | None = None) -> dict:
    """``variables`` (from ``init``) with an ``Elmo``'s biLM replaced by ``bilm_params``.

    Flax's way to load pretrained weights into part of a model: ``init`` the whole model (the biLM
    at random), then put the weights in its place, ``variables["frozen_bilm"][...]["bilm"]`` for a
    frozen ``Elmo`` and ``variables["params"][...]["bilm"]`` for a trainable one, wherever the
    ``Elmo`` sits in the model. ``variables`` may be abstract (``jax.eval_shape`` of ``init``, to
    skip drawing a random biLM). Returns new dicts (nothing is changed in place).

    ``at``: the ``Elmo`` (its module path, ``"encoder/elmo"``; ``""`` for a model that is an
    ``Elmo``), or several, to put the weights in. None: the model's one ``Elmo``; a model with
    more is refused, so that two ELMos of the same shapes never get one's weights silently.

    Raises TypeError when ``bilm_params`` is not a biLM's params tree (a config, a training
    state's params: see ``check_params_tree``), and ValueError when the weights do not have the
    shapes of the model's biLM, when the model has none, or when ``at`` names none of its ``Elmo``s.
    """
    _bilm.check_params_tree(bilm_params, name="bilm_params")
    new = _plain(bilm_params)
    new_shapes = _bilm.leaf_shapes(new)  # abstract leaves (jax.ShapeDtypeStruct) have shapes too
    found = _elmo_sites(variables)
    if not found:
        raise ValueError("with_bilm: no Elmo biLM in these variables (init the model on char ids first)")
    named = ", ".join(repr(m) for m in found)
    if at is None and len(found) > 1:
        raise ValueError(
            f"with_bilm: the model has {len(found)} Elmos ({named}); say which these weights are for with "
            f"at= (one name, or several)"
        )
    chosen = list(found) if at is None else [at] if isinstance(at, str) else list(at)
    for m in chosen:
        if m not in found:
            raise ValueError(f"with_bilm: at={m!r} is not an Elmo of this model; its Elmos are {named}")
    out = {col: _plain_dicts(tree) for col, tree in variables.items()}
    for m in chosen:
        col = found[m]
        node = out[col]
        for key in m.split("/") if m else []:
            node = node[key]
        if _bilm.leaf_shapes(node["bilm"]) != new_shapes:
            where = "/".join([col, *([m] if m else []), "bilm"])
            raise ValueError(
                f"with_bilm: the weights do not have the shapes of the biLM at {where} (another ModelConfig?)"
            )
        node["bilm"] = new
    return out


def _elmo_sites(variables: Mapping) -> dict[str, str]:
    """Module path of each ``Elmo`` with a biLM in ``variables`` -> the collection holding it."""
    found: dict[str, str] = {}

    def visit(tree: Mapping, path: tuple[str, ...], col: str) -> None:
        for key, value in tree.items():
            # In "params", only a biLM's tree is an Elmo's (a user's own "bilm" is not); a scalar
            # mix beside it is no sign, as a fixed mix (scalar_mix_parameters) has no params.
            if key == "bilm" and (col != "params" or _bilm.is_params_tree(value)):
                found["/".join(path)] = col
            elif isinstance(value, Mapping):
                visit(value, path + (key,), col)

    for col in ("params", FROZEN_COLLECTION):
        if isinstance(variables.get(col), Mapping):
            visit(variables[col], (), col)
    return found


def _plain_dicts(tree: Any) -> Any:
    """``tree`` with its mappings as new dicts (FrozenDicts included), the leaves as they are."""
    return {k: _plain_dicts(v) for k, v in tree.items()} if isinstance(tree, Mapping) else tree


# ----------------------------------------------------------------------------------------- NNX


class FrozenBiLM(nnx.Variable):
    """A biLM weight that is not trained: a variable, but not an ``nnx.Param``."""


class ScalarMixNNX(nnx.Module):
    """One scalar mix: ``weights`` ``[n_layers]`` (init 0) and ``gamma`` (init 1), both ``nnx.Param``;
    with ``fixed``, neither: those pre-softmax weights and a gamma of 1 (``ScalarMix``)."""

    def __init__(
        self,
        n_layers: int,
        layer_norm: bool = False,
        convention: str = "allennlp",
        keep_sentence_markers: bool = False,
        fixed: tuple[float, ...] | None = None,
    ):
        _check_convention(convention)
        _check_keep(keep_sentence_markers, convention, "keep_sentence_markers")
        self.fixed = _fixed_mix(fixed, n_layers)
        if self.fixed is None:
            self.weights = nnx.Param(jnp.zeros((n_layers,), jnp.float32))
            self.gamma = nnx.Param(jnp.ones((), jnp.float32))
        self.layer_norm = layer_norm
        self.convention = convention
        self.keep_sentence_markers = keep_sentence_markers

    def __call__(self, layers: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
        if self.fixed is not None:
            return _mix(self, layers, mask)
        return _mix(self, layers, mask, self.weights[...], self.gamma[...])


class ElmoNNX(nnx.Module):
    """``Elmo`` for NNX: the same arguments and outputs (see ``Elmo``), plus ``bilm_params`` (the
    biLM weights, or None when only precomputed layers are fed) and ``rngs``: an NNX module holds
    its weights, so ``from_hdf5``/``from_checkpoint`` return the module alone.

    The biLM weights are ``FrozenBiLM`` variables (``trainable_bilm=False``; excluded from
    ``nnx.state(model, nnx.Param)`` and from an ``nnx.Optimizer(..., wrt=nnx.Param)``, and read
    through ``stop_gradient``) or ``nnx.Param`` (``trainable_bilm=True``), one per leaf of the
    usual params tree, under ``.bilm``. Scalar mixes are ``scalar_mix_{k}``, dropouts ``dropout_{k}``.
    ``deterministic`` defaults to the modules' mode (``model.train()`` / ``model.eval()``), and
    ``rngs`` (as ``nnx.Dropout`` takes it) draws this call's dropout instead of the module's own.
    """

    def __init__(
        self,
        config: ModelConfig,
        bilm_params: Any = None,
        *,
        num_output_representations: int = 1,
        dropout: float = 0.5,
        do_layer_norm: bool = False,
        trainable_bilm: bool = False,
        convention: str = "allennlp",
        precision: str = "float32",
        keep_sentence_boundaries: bool = False,
        scalar_mix_parameters: tuple[float, ...] | None = None,
        rngs: nnx.Rngs,
    ):
        _check_config(config, "ElmoNNX(config, bilm_params, rngs=...)")  # before: Flax's 21 lines
        _check_settings(num_output_representations, dropout)
        _check_convention(convention)
        _check_keep(keep_sentence_boundaries, convention, "keep_sentence_boundaries")
        fixed = _fixed_mix(scalar_mix_parameters, config.n_output_layers)
        policy.check(precision)
        self.config = config
        self.num_output_representations = num_output_representations
        self.trainable_bilm = trainable_bilm
        self.convention = convention
        self.precision = precision
        if bilm_params is None and trainable_bilm:
            bilm_params = _bilm.init(rngs.params(), config)
        elif bilm_params is not None:
            _bilm.check_params(bilm_params, config, shapes=True, name="bilm_params")
        kind = nnx.Param if trainable_bilm else FrozenBiLM
        self.bilm = nnx.data(None if bilm_params is None else jax.tree.map(kind, _plain(bilm_params)))
        for k in range(num_output_representations):
            mix = ScalarMixNNX(config.n_output_layers, do_layer_norm, convention, keep_sentence_boundaries, fixed)
            setattr(self, f"scalar_mix_{k}", mix)
            setattr(self, f"dropout_{k}", nnx.Dropout(dropout, rngs=rngs))

    @classmethod
    def from_hdf5(cls, options, weights, **kwargs) -> ElmoNNX:
        config, params = _load_hdf5(options, weights)
        return cls(config, params, **kwargs)

    @classmethod
    def from_checkpoint(cls, run_dir, step=None, **kwargs) -> ElmoNNX:
        config, params = _load_checkpoint(run_dir, step)
        return cls(config, params, **kwargs)

    @classmethod
    def from_pretrained(cls, name, *, cache_dir=None, sha256=None, **kwargs) -> ElmoNNX:
        """A released model (``elmo_jax.pretrained``), downloaded once into the cache."""
        config, params = _load_pretrained(name, cache_dir, sha256)
        return cls(config, params, **kwargs)

    def bilm_weights(self) -> Any:
        """The biLM params tree as arrays (None when built without them)."""
        if self.bilm is None:
            return None
        tree = jax.tree.map(lambda v: v[...], self.bilm, is_leaf=lambda v: isinstance(v, nnx.Variable))
        return tree if self.trainable_bilm else jax.lax.stop_gradient(tree)

    def __call__(
        self, char_ids=None, layers=None, mask=None, *, deterministic: bool | None = None, rngs: nnx.Rngs | None = None
    ):
        _split_inputs(char_ids, layers, mask)
        layers, mask = _layers_from_inputs(
            self, self.bilm_weights() if char_ids is not None else None, char_ids, layers, mask
        )
        reps, out_mask = [], None
        for k in range(self.num_output_representations):
            mixed, out_mask = getattr(self, f"scalar_mix_{k}")(layers, mask)
            reps.append(getattr(self, f"dropout_{k}")(mixed, deterministic=deterministic, rngs=rngs))
        return {"elmo_representations": reps, "mask": out_mask}
