"""What to train and the one call that trains it: ``train(spec, source, settings)``.

``TrainSpec`` says what to train: a preset or options.json (``config``) with the values that
override its recipe, a vocabulary (or one built from the training text into the run dir), and
optionally another model to continue (``init_from``, anything ``warmstart.read_warmstart``
reads). ``train`` reads the warm start, writes the vocabulary when there is none, resolves the
options (a resumed run keeps its recipe and learning rate unless told otherwise) and runs
``loop.pretrain``. Its notes go to ``say(text, *argument names the text speaks of)``; its errors
name arguments by the names here (``elmo_jax._util.arguments``).
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable
from typing import Any

from elmo_jax._util.arguments import about, did_you_mean
from elmo_jax._util.atomic import is_local
from elmo_jax._util.paths import check_dir_to_make
from elmo_jax.config import (
    PRESETS,
    ConfigError,
    Options,
    TrainConfig,
    check_counts,
    read_options_json,
    saved_reset_state_prob,
)
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import NoSentences
from elmo_jax.text.vocab import MIN_COUNT
from elmo_jax.training.evaluate import no_sentence
from elmo_jax.training.loop import (
    RunSettings,
    check_heldout_fills_a_window,
    options_for_vocab,
    pretrain,
    run_devices,
    saved_options,
)


@dataclasses.dataclass(frozen=True)
class TrainSpec:
    """What to train (where and for how long: ``loop.RunSettings``)."""

    config: str | None = None
    """A preset (tiny, small, medium, original) or a bilm-tf options.json (default: a resumed
    run's own options; for a new run tiny, or with ``init_from`` the source's biLM and bilm-tf's
    recipe)."""
    vocab: str | None = None
    """An LM vocabulary (default: the run dir's vocab.txt, built from the training text)."""
    min_count: int = MIN_COUNT
    """For the vocabulary built when ``vocab`` is not given."""
    n_train_tokens: int | None = None
    """Tokens + sentences of the training text, to count epochs (default: the vocabulary's sidecar)."""
    batch_size: int | None = None
    """Rows per device (default: the config's)."""
    rows_per_draw: int | None = None
    """Rows that share a draw of sampled candidates (default: the config's; see ``TrainConfig``)."""
    reset_state_prob: float | None = None
    """Default: the config file's, a resumed run's own, else 0.1."""
    learning_rate: float | None = None
    """Default: the config file's, a resumed run's own, else bilm-tf's 0.2 (0.05 when
    ``init_from`` has no optimizer state)."""
    init_from: str | None = None
    """Continue pretraining this model (ignored when the run dir already holds a checkpoint)."""


def _print(text: str, *arguments: str) -> None:
    print(text)


def train(
    spec: TrainSpec,
    source,
    settings: RunSettings,
    heldout=None,
    say: Callable[..., None] = _print,
    on_progress: Callable[[str], None] | None = None,
) -> dict:
    """``loop.pretrain`` of what ``spec`` describes on ``source``; returns its last metrics.
    ``on_progress(doing)``: as ``pretrain``'s, and before that while the model to continue is
    read and as each shard is counted for the vocabulary."""
    from elmo_jax.text.sources import fingerprint
    from elmo_jax.text.vocab import SPECIALS
    from elmo_jax.training.warmstart import check_continues, check_source, finetune_state, read_warmstart

    check_dir_to_make(settings.run_dir)  # before any pass over the text
    # A resumed run's own options (None for a new run): without a config they are the run's.
    saved = saved_options(settings.run_dir)
    recipe = _check_recipe(spec, saved)  # before the vocabulary pass, which can take minutes, and writes
    run_devices(settings)
    if heldout is not None:  # and held-out text that is empty, binary or unreadable, as the training text is
        try:
            fingerprint(heldout)
        except NoSentences:
            raise no_sentence(heldout) from None
        if settings.eval_every != 0:  # or too short to score
            check_heldout_fills_a_window(heldout, Vocabulary(list(SPECIALS)), recipe.batch_size, recipe.unroll_steps)
    beat = on_progress or (lambda doing: None)
    warm = None
    if spec.init_from and not has_checkpoint(settings.run_dir):  # a resumed run continues from its own
        check_source(spec.init_from)  # a mistyped one, refused before the read is begun
        beat(f"reading {spec.init_from} (init_from)")
        warm = read_warmstart(spec.init_from)
        if spec.config is not None:  # refused before the vocabulary pass writes the run dir
            check_continues(warm, _config_options(spec.config, warm.model, _ANY_VOCAB).model)
    vocab_path = _run_vocab(spec, settings.run_dir, source, warm, say, beat)
    vocab = Vocabulary.load(vocab_path)
    if saved is not None and saved.get("n_tokens_vocab") not in (None, len(vocab)):
        # Said as the run's, not as the options' n_tokens_vocab: a resumed run's options are its own.
        raise about(
            ConfigError(
                f"vocab {vocab_path}: has {len(vocab)} words, but the run in {settings.run_dir} was trained with "
                f"{saved['n_tokens_vocab']} (its vocab.txt): give that vocabulary, or leave vocab out to use it"
            ),
            "vocab",
        )
    options = _options_for_run(spec, settings, vocab, vocab_path, warm, saved, say, source)
    # A fresh run's (a resumed one starts from its checkpoint, not from this state).
    seed = 0 if settings.seed is None else settings.seed
    init_state = None if warm is None else finetune_state(warm, options, vocab, seed=seed, warn_rate=False)
    return pretrain(
        options,
        vocab,
        source,
        settings,
        heldout=heldout,
        init_state=init_state,
        on_progress=on_progress,
        init_from=spec.init_from,
    )


def has_checkpoint(run_dir: str) -> bool:
    """Whether ``run_dir`` (local or gs://) holds a checkpoint."""
    return bool(saved_steps(run_dir))


def saved_steps(run_dir: str) -> list[int]:
    """The committed checkpoints' steps in ``run_dir`` (local or gs://), by their directories alone,
    without opening Orbax. A local save in flight is a temporary directory until its rename
    commits it; on an object store Orbax writes into the step's own directory and commits it
    with a ``commit_success.txt`` there (``elmo_jax.training.checkpoint``)."""
    from etils import epath

    checkpoints, local = epath.Path(run_dir, "checkpoints"), is_local(run_dir)
    if not checkpoints.is_dir():
        return []
    return sorted(
        int(p.name)
        for p in checkpoints.iterdir()
        if p.name.isdigit() and (local or (p / "commit_success.txt").exists())
    )


def newest_meta(run_dir: str) -> dict | None:
    """The newest checkpoint's metadata (its training files, held-out files, options), read as JSON
    without Orbax or the devices, so that a command can look before jax.distributed starts; None
    when there is no checkpoint or its file does not parse (the restore then says why)."""
    import json

    from etils import epath

    steps = saved_steps(run_dir)
    if not steps:
        return None
    try:
        meta = json.loads(epath.Path(run_dir, "checkpoints", str(steps[-1]), "meta", "metadata").read_bytes())
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def _run_vocab(spec: TrainSpec, run_dir: str, source, warm, say, beat: Callable[[str], None]) -> str:
    """``spec.vocab``, or the run dir's vocab.txt, built from the training text (and ``warm``'s words) when missing."""
    from etils import epath

    from elmo_jax.text.vocab import build_vocab, count_tokens, write_vocab

    if spec.vocab is not None:
        if spec.min_count != MIN_COUNT:  # (a value that is not used is said, not ignored)
            say(f"min_count {spec.min_count}: not used: the vocabulary is given ({spec.vocab})", "min_count")
        return spec.vocab
    vocab_path = os.path.join(run_dir, "vocab.txt")
    if epath.Path(vocab_path).exists():  # the run dir may be gs:// (etils.epath)
        _say_min_count_unused(spec.min_count, vocab_path, say)
    else:
        try:
            counts, n_tokens, n_sentences = count_tokens(
                source,
                lambda i: beat(
                    f"counting the words of {source.name(i)} for the vocabulary (shard {i + 1} of {len(source)})"
                ),
            )
        except NoSentences:  # said as with a vocabulary given
            raise no_sentence(source, training=True) from None
        epath.Path(run_dir).mkdir(parents=True, exist_ok=True)  # once the text is known good
        # Continuing a model: its words keep their softmax rows, the new text's words are added.
        old_words = warm.vocab.words if warm is not None and warm.vocab is not None else None
        write_vocab(
            build_vocab(counts, min_count=spec.min_count, extend=old_words),
            vocab_path,
            n_tokens,
            n_sentences,
            [source.name(i) for i in range(len(source))],
            min_count=spec.min_count,
        )
        extended = f", {len(old_words)} words of {spec.init_from} included" if old_words else ""
        say(f"no vocab: wrote {vocab_path}{extended}", "vocab")
    return vocab_path


def _say_min_count_unused(min_count: int, vocab_path: str, say) -> None:
    """A note when ``min_count`` is not the one the run's own vocabulary was built with: a run
    keeps its vocabulary (its softmax has a row a word), so the flag changes nothing. The same
    command, rerun to resume, says nothing."""
    from elmo_jax.text.vocab import read_vocab_meta

    built = (read_vocab_meta(vocab_path) or {}).get("min_count")
    if min_count != (MIN_COUNT if built is None else built):
        was = "" if built is None else f" with min_count {built}"
        say(
            f"min_count {min_count}: not used: the run's vocabulary {vocab_path} was built{was}, and a run keeps it",
            "min_count",
        )


def _options_for_run(
    spec: TrainSpec, settings: RunSettings, vocab, vocab_path: str, warm, saved: dict | None, say, source
) -> Options:
    """The run's Options: ``spec.config`` (or ``warm``'s biLM, or a resumed run's ``saved``
    options) with the values that override its recipe."""
    counted, other = _vocab_count(vocab_path, source, taken=spec.n_train_tokens is None)
    n_train_tokens = spec.n_train_tokens or counted
    given = _config_keys(spec.config)
    in_config = "n_train_tokens" in given
    # The run's own count (None: it never had one); a new_data session's text is another one.
    if n_train_tokens is None and saved is not None and not in_config and not settings.new_data:
        n_train_tokens = saved.get("n_train_tokens")
    uncounted = n_train_tokens is None and not in_config
    if uncounted and settings.steps is None:
        # Without it epochs (or the options' n_epochs) would count 1B Word's 768,648,884 tokens.
        raise _no_token_count(vocab_path, other is not None, settings, saved)
    # A resumed run keeps its recipe and its learning rate unless an argument or the config says
    # otherwise (pretrain's start line names both), and without a config it keeps its own options:
    # the same command resumes an init_from run, whose source is no longer read, and a run that
    # started from a config not given again.
    config = _config(spec, warm is not None, saved)
    learning_rate = spec.learning_rate
    if learning_rate is None and warm is not None and warm.bilm_acc is None and "learning_rate" not in given:
        from elmo_jax.training.warmstart import NO_ACCUMULATORS_LEARNING_RATE as learning_rate

        say(
            f"{spec.init_from} has no optimizer state (Adagrad restarts at 1.0): learning rate {learning_rate} "
            f"instead of bilm-tf's 0.2 (learning_rate to choose)",
            "learning_rate",
        )
    reset_state_prob = spec.reset_state_prob
    if reset_state_prob is None and saved is not None and "reset_state_prob" not in given:
        reset_state_prob = saved_reset_state_prob(saved)
    if learning_rate is None and saved is not None and "learning_rate" not in given:
        learning_rate = saved.get("learning_rate")
    options = training_options(
        config,
        vocab,
        spec.batch_size,
        n_train_tokens,
        reset_state_prob,
        warm.model if warm is not None else None,
        learning_rate,
        spec.rows_per_draw,
    )
    if uncounted:  # saved as null, not as the recipe's 1B Word count, which a resume would count epochs in
        options = dataclasses.replace(options, train=dataclasses.replace(options.training, n_train_tokens=None))
    return options


def _no_token_count(vocab_path: str, other_text: bool, settings: RunSettings, saved: dict | None) -> ConfigError:
    """The refusal of epochs that nothing counts: the vocabulary's sidecar (missing, or of
    ``other_text``), the config, and the run (``saved``: none, or of the text before new_data)."""
    run_count = ""
    if saved is not None:
        run_count = (
            f", and the count of the run in {settings.run_dir} is of the text before new_data"
            if settings.new_data and saved.get("n_train_tokens")
            else f", nor does the run in {settings.run_dir}"
        )
    sidecar = (
        f"{vocab_path}.json counts other text than the training files"
        if other_text
        else f"{vocab_path} has no token-count sidecar ({vocab_path}.json)"
    )
    return about(
        ConfigError(
            f"{sidecar} and config sets no token count{run_count}, so epochs cannot be counted; give "
            "n_train_tokens (tokens + sentences of the training text) or steps"
            # A run keeps its vocabulary: only a new one's can be rebuilt.
            + (", or rebuild it with elmo-jax vocab" if saved is None else "")
        ),
        "config",
        "n_train_tokens",
        "steps",
        *(["new_data"] if "new_data" in run_count else []),
    )


def _vocab_count(vocab_path: str, source, taken: bool) -> tuple[int | None, str | None]:
    """The token count in ``vocab_path``'s sidecar, if it counted ``source``'s files, and how the
    files it counted differ (None: the same, or not known); ``taken``: warned when they differ."""
    from elmo_jax.text.vocab import read_vocab_meta

    meta = read_vocab_meta(vocab_path) or {}
    other = _counted_other_text(meta, source)
    if other is None:
        return meta.get("n_train_tokens"), None
    if taken:
        # Its count would set the epochs of another text: a vocabulary of a 200-line slice made a
        # 1-epoch run of the whole text stop after 1 % of it: said, not done silently.
        warnings.warn(
            f"{vocab_path}.json counts other text than the training files ({other}): its "
            f"{meta.get('n_train_tokens')} tokens are not taken for an epoch",
            stacklevel=3,
        )
    return None, other


def _counted_other_text(meta: dict, source) -> str | None:
    """How the files a vocabulary sidecar counted differ from ``source``'s (None: the same, or
    not known)."""
    counted = meta.get("files")
    if not isinstance(counted, list) or not hasattr(source, "name"):
        return None
    mine = [source.name(i) for i in range(len(source))]

    def paths(names: list) -> set:
        return {os.path.abspath(n) if is_local(n) else n for n in map(str, names)}

    # By name too: the sidecar keeps the paths as given, relative to where elmo-jax vocab ran.
    if paths(counted) == paths(mine) or sorted(map(os.path.basename, map(str, counted))) == sorted(
        map(os.path.basename, mine)
    ):
        return None
    first = ", ".join(map(str, counted[:2])) + (", ..." if len(counted) > 2 else "")
    return f"it counted {len(counted)} file(s): {first}"


def training_options(
    config: str | Options | None,
    vocab,
    batch_size: int | None,
    n_train_tokens: int | None,
    reset_state_prob: float | None = None,
    model=None,
    learning_rate: float | None = None,
    rows_per_draw: int | None = None,
) -> Options:
    """Options for a run: ``config`` (a preset, an options.json, or a resumed run's ``Options``),
    or with ``config=None`` the biLM ``model`` of an ``init_from`` source with bilm-tf's training
    recipe."""
    strict = config is not None and config not in PRESETS
    options = _config_options(config, model, len(vocab))
    overrides: tuple[tuple[str, Any], ...] = (
        ("batch_size", batch_size),
        ("reset_state_prob", reset_state_prob),
        ("learning_rate", learning_rate),
        ("rows_per_draw", rows_per_draw),
    )
    if any(value is not None for _, value in overrides):
        train = _overridden(options.train or TrainConfig(n_tokens_vocab=len(vocab)), dict(overrides))
        options = dataclasses.replace(options, train=train)
    return options_for_vocab(options, vocab, n_train_tokens, strict=strict)


def _overridden(train: TrainConfig, overrides: dict[str, Any]) -> TrainConfig:
    """``train`` with the ``overrides`` that are not None; a ``ConfigError`` names those arguments
    (the CLI writes its flags)."""
    given = {key: value for key, value in overrides.items() if value is not None}
    try:
        return dataclasses.replace(train, **given)
    except ConfigError as e:
        raise about(e, *given) from None


def _config(spec: TrainSpec, warm: bool, saved: dict | None) -> str | Options | None:
    """What the run's options start from: ``spec.config``; without it a resumed run's ``saved``
    options, else for a new run tiny, or with an init_from source (``warm``) None (its biLM)."""
    if spec.config is None and saved is not None:
        return Options.from_dict(saved, where="the run's newest checkpoint", saved=True)
    return spec.config or (None if warm else "tiny")


def _check_recipe(spec: TrainSpec, saved: dict | None) -> TrainConfig:
    """``spec.config`` and the values ``spec`` overrides in its recipe, checked before any text
    is read: the vocabulary's size is not known yet, and no check here depends on it. Returns
    the recipe (its vocabulary size a placeholder)."""
    from elmo_jax.text.vocab import check_vocab_arguments

    check_counts(1, optional=True, n_train_tokens=spec.n_train_tokens)  # 0 was taken as not given
    check_vocab_arguments(spec.min_count)  # even with a vocab given, where it is not used: a typo all the same
    config = _config(spec, bool(spec.init_from), saved)
    if isinstance(config, Options):  # a resumed run's, whose vocabulary is the run's own
        train = config.training
    elif config is None:  # the recipe of an init_from source, whose model is not read yet
        train = _recipe_train(_ANY_VOCAB)
    else:
        train = _config_options(config, None, _ANY_VOCAB).train or TrainConfig(n_tokens_vocab=_ANY_VOCAB)
    overrides = dict(
        batch_size=spec.batch_size,
        rows_per_draw=spec.rows_per_draw,
        reset_state_prob=spec.reset_state_prob,
        learning_rate=spec.learning_rate,
    )
    return _overridden(train, overrides)


_ANY_VOCAB = 10**9  # a vocabulary size for checks that do not depend on it


def _config_options(config: str | Options | None, model, n_tokens_vocab: int) -> Options:
    """``config``'s options for a vocabulary of ``n_tokens_vocab`` words: a preset's, an
    options.json's, or with ``config=None`` the biLM ``model`` with bilm-tf's recipe."""
    if isinstance(config, Options):
        return config
    if config is None:
        return Options(model=model, train=_recipe_train(n_tokens_vocab))
    if config in PRESETS:
        return Options(model=PRESETS[config], train=TRAIN_DEFAULTS[config](n_tokens_vocab))
    return _options_file(config)


def _options_file(config: str) -> Options:
    """The options.json ``config`` names; a ``ConfigError`` when it is neither that nor a preset."""
    if not os.path.isfile(config):
        raise about(
            ConfigError(
                f"config {config!r}: neither a preset ({', '.join(PRESETS)}) nor an options.json file"
                + did_you_mean(config, PRESETS)
            ),
            "config",
        )
    return Options.load(config)


def _config_keys(config: str | None) -> frozenset[str]:
    """The keys ``config`` gives itself, when it is an options.json (presets give none; a null, as a
    run saved without a token count writes it, gives none)."""
    if config is None or not os.path.isfile(config):
        return frozenset()
    try:
        d = read_options_json(config)
    except (OSError, ConfigError):
        return frozenset()  # Options.load reports a bad file with its own message
    return frozenset(key for key, value in d.items() if value is not None) if isinstance(d, dict) else frozenset()


def _tiny_train(n_tokens_vocab: int) -> TrainConfig:
    # Sized for a CPU: fewer negatives and rows than bilm-tf's GPU recipe.
    return TrainConfig(
        n_tokens_vocab=max(n_tokens_vocab, 1025),
        batch_size=32,
        unroll_steps=20,
        n_negative_samples_batch=1024,
        n_epochs=1,
    )


def _recipe_train(n_tokens_vocab: int) -> TrainConfig:
    return TrainConfig(n_tokens_vocab=max(n_tokens_vocab, 8193))


# Each preset's training recipe, for a vocabulary of n words.
TRAIN_DEFAULTS = {"tiny": _tiny_train, "small": _recipe_train, "medium": _recipe_train, "original": _recipe_train}
