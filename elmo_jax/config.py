"""Model and training configuration, read from and written to bilm-tf ``options.json``.

All configs are frozen, hashable dataclasses (tuples, never lists) so that they can be passed
to ``jax.jit`` as static arguments: one compile per config, never a retrace on an equal copy.

bilm-tf keeps every option in one JSON object: ``{"lstm": {...}, "char_cnn": {...}}`` for the
model plus top-level training keys. ``Options`` mirrors that file; ``ModelConfig`` is the part
the forward pass needs and ``TrainConfig`` the rest.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import os
from collections.abc import Mapping
from typing import Any

from elmo_jax._util.arguments import about, did_you_mean
from elmo_jax._util.atomic import open_binary, write_text_atomic
from elmo_jax._util.utf8 import utf16_hint

ACTIVATIONS = ("relu", "tanh")


class ConfigError(ValueError):
    """A configuration value or file is not what elmo_jax expects."""


def _fail(where: str, msg: str) -> None:
    raise ConfigError(f"{where}: {msg}")


def _check_int(where: str, name: str, value: Any, minimum: int = 1) -> None:
    if not _is_int(value, minimum):
        _fail(where, f"'{name}' must be an integer >= {minimum}, found {value!r}")


def _check_type(where: str, name: str, value: Any, kind: type) -> None:
    """A sub-config given as something else (a dict of its keys): refused here, not as a missing
    attribute at its first use."""
    if not isinstance(value, kind):
        _fail(where, f"'{name}' must be of type {kind.__name__}, found {type(value).__name__}")


def _is_int(value: Any, minimum: int) -> bool:
    return not isinstance(value, bool) and isinstance(value, numbers.Integral) and int(value) >= minimum


def _check_number(where: str, name: str, value: Any) -> None:
    """A string or a bool where a number belongs ("0.1" in a hand-edited options.json): refused
    by name, not as a ``TypeError`` from the range check that follows."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        _fail(where, f"'{name}' must be a number, found {value!r}")


def _plain_numbers(config: Any) -> None:
    """A config's numpy scalars (a sweep's ``np.int64(512)``) as Python's int and float, once they
    have passed the checks: they compare and hash alike, but ``json`` cannot write them
    (``Options.save``)."""
    for field in dataclasses.fields(config):
        value = getattr(config, field.name)
        if isinstance(value, numbers.Number) and not isinstance(value, (int, float)) and hasattr(value, "item"):
            object.__setattr__(config, field.name, value.item())


def _check_bool(where: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        _fail(where, f"'{name}' must be true or false, found {value!r}")


def check_counts(minimum: int, optional: bool = False, **values: Any) -> None:
    """A ``ConfigError`` about the first of the arguments ``values`` that is not an integer of at
    least ``minimum`` (None passes when ``optional``): ``save_every must be an integer >= 1; got 0``,
    marked as about that argument, so that the command line names its flag."""
    for name, value in values.items():
        if not (optional and value is None) and not _is_int(value, minimum):
            raise about(ConfigError(f"{name} must be an integer >= {minimum}; got {value!r}"), name)


def _check_clip(where: str, name: str, value: Any) -> None:
    # Written as a range, not as `value < 0`, so that NaN (false to every comparison) fails too; inf
    # is refused like a learning_rate of inf: null already means no clipping.
    if value is not None and (
        isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= float(value) < math.inf
    ):
        _fail(where, f"'{name}' must be a finite number >= 0 or null (0/null: no clipping), found {value!r}")


@dataclasses.dataclass(frozen=True)
class CharCNNConfig:
    """The character CNN token encoder (bilm-tf ``char_cnn``)."""

    embedding_dim: int = 16
    """Width of each character embedding (``char_cnn.embedding.dim``)."""
    filters: tuple[tuple[int, int], ...] = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))
    """``(width, count)`` per convolution, in concatenation order."""
    n_highway: int = 2
    """Highway layers after the convolutions (bilm-tf: missing or null means 0)."""
    activation: str = "relu"
    """Activation after the max-pool: ``relu`` or ``tanh``. The highway is always ReLU."""
    n_characters: int = 262
    """Char vocabulary: 262 at inference (ids shifted by +1, 0 = padding), 261 in bilm-tf training."""
    max_characters_per_token: int = 50
    """Char slots per token; a token's UTF-8 bytes are cut at this minus 2 (begin/end of word)."""

    def __post_init__(self):
        where = "char_cnn"
        _check_int(where, "embedding.dim", self.embedding_dim)
        _check_int(where, "n_highway", self.n_highway, minimum=0)
        if not self.filters:
            _fail(where, "'filters' must list at least one [width, count] pair, found []")
        for f in self.filters:
            # Integers only: int() would make a width of 1.7 a 1 and fail on "x" outside ConfigError.
            if len(f) != 2 or not all(_is_int(v, 1) for v in f):
                _fail(where, f"each filter must be two integers [width >= 1, count >= 1], found {list(f)}")
        object.__setattr__(self, "filters", tuple(tuple(int(v) for v in f) for f in self.filters))
        if self.activation not in ACTIVATIONS:
            _fail(where, f"'activation' must be one of {ACTIVATIONS}, found {self.activation!r}")
        if self.n_characters not in (261, 262):
            _fail(
                where, f"'n_characters' must be 261 (bilm-tf training) or 262 (inference), found {self.n_characters!r}"
            )
        _check_int(where, "max_characters_per_token", self.max_characters_per_token, minimum=3)
        widest = max(w for w, _ in self.filters)
        if widest > self.max_characters_per_token:
            _fail(where, f"filter width {widest} exceeds max_characters_per_token {self.max_characters_per_token}")
        _plain_numbers(self)

    @property
    def n_filters(self) -> int:
        """Width of the concatenated max-pooled convolutions."""
        return sum(n for _, n in self.filters)


@dataclasses.dataclass(frozen=True)
class LSTMConfig:
    """The biLSTM (bilm-tf ``lstm``)."""

    dim: int = 4096
    """LSTM cell size (``c``)."""
    projection_dim: int = 512
    """Size of ``h``, of the token vectors and of each direction's output."""
    n_layers: int = 2
    """Layers per direction (bilm-tf default 1)."""
    cell_clip: float | None = 3.0
    """Clip ``c`` to +-cell_clip; 0 or None: no clipping (bilm-tf default None)."""
    proj_clip: float | None = 3.0
    """Clip ``h`` to +-proj_clip; 0 or None: no clipping (bilm-tf default None)."""
    use_skip_connections: bool = True
    """Layers >= 1 add their input to their output (bilm-tf default False)."""

    def __post_init__(self):
        where = "lstm"
        _check_int(where, "dim", self.dim)
        _check_int(where, "projection_dim", self.projection_dim)
        _check_int(where, "n_layers", self.n_layers)
        _check_clip(where, "cell_clip", self.cell_clip)
        _check_clip(where, "proj_clip", self.proj_clip)
        _check_bool(where, "use_skip_connections", self.use_skip_connections)
        _plain_numbers(self)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the biLM forward pass needs."""

    char_cnn: CharCNNConfig = CharCNNConfig()
    lstm: LSTMConfig = LSTMConfig()

    def __post_init__(self):
        _check_type("model", "char_cnn", self.char_cnn, CharCNNConfig)
        _check_type("model", "lstm", self.lstm, LSTMConfig)
        if self.char_cnn.n_filters < self.lstm.projection_dim:
            _fail(
                "model",
                f"the char CNN has {self.char_cnn.n_filters} filters, fewer than "
                f"lstm.projection_dim {self.lstm.projection_dim} (bilm-tf requires n_filters >= projection_dim)",
            )

    def with_shifted_chars(self) -> ModelConfig:
        """This config with ``n_characters`` 262: the model always reads shifted char ids with a
        padding row 0, whatever a bilm-tf training file (261) says."""
        if self.char_cnn.n_characters == 262:
            return self
        return dataclasses.replace(self, char_cnn=dataclasses.replace(self.char_cnn, n_characters=262))

    @property
    def output_dim(self) -> int:
        """Width of every ELMo layer: ``2 * projection_dim``."""
        return 2 * self.lstm.projection_dim

    @property
    def n_output_layers(self) -> int:
        """ELMo layers: the token layer plus one per LSTM layer."""
        return self.lstm.n_layers + 1


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """bilm-tf's top-level training keys (bilm-tf's ``bin/train_elmo.py`` has the released recipe)."""

    n_tokens_vocab: int = 793471
    """Softmax vocabulary size (the vocab file's line count)."""
    batch_size: int = 128
    """Rows per device; the global batch is rows x devices."""
    unroll_steps: int = 20
    """Window length: inputs ``stream[:T]``, targets ``stream[1:T+1]``."""
    n_negative_samples_batch: int = 8192
    """Sampled-softmax negatives per step, per direction, per draw (``rows_per_draw``)."""
    dropout: float = 0.1
    """Dropout on each LSTM layer's input and on the top output."""
    all_clip_norm_val: float = 10.0
    """Global-norm gradient clipping."""
    n_epochs: int = 10
    n_train_tokens: int | None = 768648884
    """Tokens per epoch (bilm-tf's default is the 1B Word count; set it from the vocab pass).
    None (``null`` in options.json): a run started for a number of steps on text it never counted,
    saved so that its resume cannot count epochs in 1B Word's tokens."""
    bidirectional: bool = True
    """Only bidirectional models are supported (a missing key means true here; see docs/formats.md)."""
    learning_rate: float = 0.2
    """Adagrad learning rate (bilm-tf default 0.2)."""
    sample_softmax: bool = True
    """bilm-tf's switch between sampled and full softmax in training; must be true here."""
    share_embedding_softmax: bool = False
    """bilm-tf option for word-input models only; must be false for char models."""
    reset_state_prob: float = 0.1
    """Not bilm-tf's key: the chance that a row's LSTM state is zeroed at a sentence start, so that
    the biLM also learns to start from zero state, as evaluation and ELMo extraction do.
    bilm-tf carries the state forever (0.0), and early checkpoints of that recipe can be useless
    from zero state; 0.1 removes that at no measured cost (experiments/README.md, "The early
    blow-up"). A fresh run gets 0.1 unless told otherwise, an options file without the key
    included; a run dir saved before this default resumes at 0.0 (``saved_reset_state_prob``)."""
    rows_per_draw: int = 0
    """Not bilm-tf's key: the rows that share one draw of sampled candidates; it divides
    ``batch_size``. 0 (and a file without the key): all of a device's rows share one. bilm-tf
    draws once per GPU tower of ``batch_size`` rows, so ``batch_size`` 384 with
    ``rows_per_draw`` 128 on one device is its 3-GPU recipe exactly."""

    def __post_init__(self):
        where = "training options"
        for name in (
            "n_tokens_vocab",
            "batch_size",
            "unroll_steps",
            "n_negative_samples_batch",
            "n_epochs",
        ):
            _check_int(where, name, getattr(self, name))
        if self.n_train_tokens is not None:
            _check_int(where, "n_train_tokens", self.n_train_tokens)
        for name in ("dropout", "all_clip_norm_val", "learning_rate", "reset_state_prob"):
            _check_number(where, name, getattr(self, name))
        for name in ("bidirectional", "sample_softmax", "share_embedding_softmax"):
            _check_bool(where, name, getattr(self, name))
        if not 0.0 <= self.reset_state_prob <= 1.0:
            _fail(where, f"'reset_state_prob' must be in [0, 1], found {self.reset_state_prob!r}")
        _check_int(where, "rows_per_draw", self.rows_per_draw, minimum=0)
        if self.rows_per_draw and self.batch_size % self.rows_per_draw:
            _fail(
                where,
                f"'rows_per_draw' ({self.rows_per_draw}) must divide 'batch_size' ({self.batch_size}), "
                f"the rows of one device, or be 0 (one draw for all of them)",
            )
        if not 0.0 <= self.dropout < 1.0:
            _fail(where, f"'dropout' must be in [0, 1), found {self.dropout!r}")
        if not self.all_clip_norm_val > 0:
            _fail(where, f"'all_clip_norm_val' must be > 0, found {self.all_clip_norm_val!r}")
        if not 0 < self.learning_rate < math.inf:
            _fail(where, f"'learning_rate' must be a finite number > 0, found {self.learning_rate!r}")
        if self.bidirectional is not True:
            _fail(where, "'bidirectional' must be true: elmo_jax trains bidirectional biLMs only")
        if self.sample_softmax is not True:  # taken and ignored before: a full-softmax recipe trained sampled
            _fail(
                where,
                "'sample_softmax' must be true: elmo_jax trains with the sampled softmax only "
                "(its held-out perplexity is the full softmax's)",
            )
        if self.share_embedding_softmax:
            _fail(where, "'share_embedding_softmax' needs word inputs; elmo_jax models are character models")
        if self.n_negative_samples_batch >= self.n_tokens_vocab:
            _fail(
                where,
                f"'n_negative_samples_batch' ({self.n_negative_samples_batch}) must be smaller than "
                f"'n_tokens_vocab' ({self.n_tokens_vocab})",
            )
        _plain_numbers(self)

    @property
    def draws_per_device(self) -> int:
        """The candidate draws of a step on one device, per direction: ``batch_size / rows_per_draw``."""
        return self.batch_size // self.rows_per_draw if self.rows_per_draw else 1


def saved_reset_state_prob(saved: Mapping) -> float:
    """The ``reset_state_prob`` a run's saved options dict means. Before 0.1 became the default,
    a run at bilm-tf's 0.0 was saved without the key, so a missing key means 0.0 here (and 0.1 to
    a fresh run's options file): a resumed run never changes recipe midway."""
    return float(saved.get("reset_state_prob", 0.0))


_LSTM_KEYS = {"dim", "projection_dim", "n_layers", "cell_clip", "proj_clip", "use_skip_connections"}
_CNN_KEYS = {"embedding", "filters", "n_highway", "activation", "n_characters", "max_characters_per_token"}
_TRAIN_KEYS = {f.name for f in dataclasses.fields(TrainConfig)}


def _require(where: str, d: Mapping, key: str):
    if key not in d:
        _fail(where, f"missing required key '{key}'")
    return d[key]


def _reject_unknown(where: str, d: Mapping, known: set) -> None:
    unknown = sorted(set(d) - known)
    if unknown:
        _fail(where, f"unknown keys {unknown}; expected only {sorted(known)}")


@dataclasses.dataclass(frozen=True)
class Options:
    """A whole bilm-tf ``options.json``: the model, plus training keys when the file has them."""

    model: ModelConfig = ModelConfig()
    train: TrainConfig | None = None

    def __post_init__(self):
        _check_type("options", "model", self.model, ModelConfig)
        if self.train is not None:
            _check_type("options", "train", self.train, TrainConfig)

    @property
    def training(self) -> TrainConfig:
        """The training keys, for code that trains: a ``ConfigError`` when the file has none (a
        released model's options.json describes the model alone)."""
        if self.train is None:
            raise ConfigError(
                "these options have no training keys (batch_size, n_tokens_vocab, ...): they "
                "describe a model to run, not a run to train; give them one: "
                "Options(model=..., train=TrainConfig(n_tokens_vocab=len(vocab), ...))"
            )
        return self.train

    @classmethod
    def from_dict(cls, d: Mapping, where: str = "options", saved: bool = False) -> Options:
        """``saved``: ``d`` is a run's own record (a run dir's options.json, a checkpoint's), where a
        missing ``reset_state_prob`` means 0.0 (``saved_reset_state_prob``), not a fresh run's 0.1."""
        if not isinstance(d, Mapping):
            _fail(where, f"expected a JSON object, found {type(d).__name__}")
        _reject_unknown(where, d, {"lstm", "char_cnn"} | _TRAIN_KEYS)
        lstm = _require(where, d, "lstm")
        cnn = _require(where, d, "char_cnn")
        if not isinstance(lstm, Mapping) or not isinstance(cnn, Mapping):
            _fail(where, "'lstm' and 'char_cnn' must be JSON objects")
        _reject_unknown(f"{where}: lstm", lstm, _LSTM_KEYS)
        _reject_unknown(f"{where}: char_cnn", cnn, _CNN_KEYS)
        emb = _require(f"{where}: char_cnn", cnn, "embedding")
        if not isinstance(emb, Mapping) or set(emb) != {"dim"}:
            _fail(f"{where}: char_cnn", f"'embedding' must be {{\"dim\": N}}, found {emb!r}")
        filters = _require(f"{where}: char_cnn", cnn, "filters")
        if not isinstance(filters, (list, tuple)) or not all(isinstance(f, (list, tuple)) for f in filters):
            _fail(f"{where}: char_cnn", f"'filters' must be a list of [width, count], found {filters!r}")
        cnn_where, lstm_where = f"{where}: char_cnn", f"{where}: lstm"
        cnn_values = dict(
            embedding_dim=emb["dim"],
            filters=tuple(tuple(f) for f in filters),
            n_highway=cnn.get("n_highway") or 0,
            activation=_require(cnn_where, cnn, "activation"),
            n_characters=_require(cnn_where, cnn, "n_characters"),
            max_characters_per_token=_require(cnn_where, cnn, "max_characters_per_token"),
        )
        lstm_values = dict(
            dim=_require(lstm_where, lstm, "dim"),
            projection_dim=_require(lstm_where, lstm, "projection_dim"),
            n_layers=lstm.get("n_layers", 1),
            cell_clip=lstm.get("cell_clip"),
            proj_clip=lstm.get("proj_clip"),
            # bilm-tf reads it with .get: missing or null is false. Not bool(): "false" would be true.
            use_skip_connections=lstm.get("use_skip_connections") or False,
        )
        train_values = {k: d[k] for k in _TRAIN_KEYS if k in d}
        if train_values and saved:
            train_values["reset_state_prob"] = saved_reset_state_prob(d)
        if train_values:
            for k in ("n_tokens_vocab", "batch_size", "unroll_steps", "n_negative_samples_batch"):
                _require(where, d, k)
        # The dataclasses validate themselves and name the section; prefix the file.
        try:
            model = ModelConfig(char_cnn=CharCNNConfig(**cnn_values), lstm=LSTMConfig(**lstm_values))
            train = TrainConfig(**train_values) if train_values else None
        except ConfigError as e:
            raise ConfigError(f"{where}: {e}") from None
        return cls(model=model, train=train)

    def to_dict(self, n_characters: int | None = None) -> dict:
        """bilm-tf's JSON layout; ``n_characters`` overrides the stored value (writers use 262)."""
        c, l = self.model.char_cnn, self.model.lstm
        d: dict = {
            "lstm": {
                "dim": l.dim,
                "projection_dim": l.projection_dim,
                "n_layers": l.n_layers,
                "cell_clip": l.cell_clip,
                "proj_clip": l.proj_clip,
                "use_skip_connections": l.use_skip_connections,
            },
            "char_cnn": {
                "embedding": {"dim": c.embedding_dim},
                "filters": [list(f) for f in c.filters],
                "n_highway": c.n_highway,
                "activation": c.activation,
                "n_characters": n_characters or c.n_characters,
                "max_characters_per_token": c.max_characters_per_token,
            },
        }
        if self.train is not None:
            # reset_state_prob is written even at 0.0, since a missing key now means 0.1 to a
            # fresh run; bilm-tf's and AllenNLP's readers ignore top-level keys they do not use.
            d.update(dataclasses.asdict(self.train))
            if not self.train.rows_per_draw:  # a file without it means the same: written as before
                del d["rows_per_draw"]
        return d

    @classmethod
    def load(cls, path: str | os.PathLike, saved: bool = False) -> Options:
        """``saved``: as in ``from_dict``, for a run dir's own options.json."""
        return cls.from_dict(read_options_json(path), where=os.fspath(path), saved=saved)

    def save(self, path: str | os.PathLike, n_characters: int | None = 262) -> None:
        """Writes atomically (temp file, then rename). bilm-tf inference requires n_characters 262."""
        write_text_atomic(path, json.dumps(self.to_dict(n_characters), indent=2) + "\n")


# The first 8 bytes of an HDF5 file (h5py writes its superblock at offset 0).
HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


def read_options_json(path: str | os.PathLike) -> Any:
    """The JSON value of the options file ``path``, unchecked; a one-line ``ConfigError`` for a
    file that is missing, not UTF-8 or not JSON."""
    path = os.fspath(path)
    raw = b""
    try:
        with open_binary(path) as f:
            raw = f.read()
        return json.loads(raw.decode("utf-8-sig"))  # a byte-order mark, as Windows editors write
    except FileNotFoundError:
        raise ConfigError(f"{path}: options file not found") from None
    except IsADirectoryError:  # a run dir given for its options.json, say
        raise ConfigError(f"{path}: is a directory, not an options file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON (line {e.lineno}, column {e.colno}: {e.msg})") from None
    except UnicodeDecodeError as e:  # a weights file or an archive given for the options
        hint = utf16_hint(raw)  # as vocabularies and text are told
        if raw.startswith(HDF5_SIGNATURE):  # (options, weights) is the order of every loader's two paths
            hint = "; it is an HDF5 file: the weight file, given where the options go?"
        raise ConfigError(f"{path}: not an options.json: not UTF-8 text ({e.reason} at byte {e.start}){hint}") from None


_RELEASED_FILTERS = ((1, 32), (2, 32), (3, 64), (4, 128), (5, 256), (6, 512), (7, 1024))


def _released(dim: int, projection_dim: int, n_highway: int) -> ModelConfig:
    return ModelConfig(
        char_cnn=CharCNNConfig(embedding_dim=16, filters=_RELEASED_FILTERS, n_highway=n_highway),
        lstm=LSTMConfig(
            dim=dim, projection_dim=projection_dim, n_layers=2, cell_clip=3.0, proj_clip=3.0, use_skip_connections=True
        ),
    )


PRESETS: dict[str, ModelConfig] = {
    "small": _released(1024, 128, 1),
    "medium": _released(2048, 256, 1),
    "original": _released(4096, 512, 2),
    # Trains in minutes on a 2-core CPU; for tests, demos and the bundled sample.
    "tiny": ModelConfig(
        char_cnn=CharCNNConfig(embedding_dim=8, filters=((1, 16), (2, 16), (3, 32), (4, 64)), n_highway=1),
        lstm=LSTMConfig(
            dim=256, projection_dim=64, n_layers=2, cell_clip=3.0, proj_clip=3.0, use_skip_connections=True
        ),
    ),
}


def preset(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}{did_you_mean(name, PRESETS)}")
    return PRESETS[name]
