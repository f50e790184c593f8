import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import FIXTURES

from elmo_jax.compat.hdf5 import expected_datasets
from elmo_jax.config import PRESETS, ConfigError, ModelConfig, Options, TrainConfig, preset
from elmo_jax.model import bilm

# bilm-tf's own training test options (tests/test_training.py): no clip or skip keys.
BILM_TF_TRAIN_OPTIONS = {
    "n_tokens_vocab": 32,
    "n_negative_samples_batch": 16,
    "n_train_tokens": 134,
    "batch_size": 2,
    "unroll_steps": 10,
    "n_epochs": 50,
    "all_clip_norm_val": 1.0,
    "dropout": 0.1,
    "lstm": {"dim": 16, "projection_dim": 8, "n_layers": 2},
    "bidirectional": True,
    "char_cnn": {
        "n_characters": 261,
        "max_characters_per_token": 10,
        "filters": [[1, 8], [2, 8], [3, 16], [4, 32], [5, 64]],
        "activation": "tanh",
        "embedding": {"dim": 4},
        "n_highway": 1,
    },
}


@pytest.mark.parametrize("name,count", [("small", 13_593_296), ("medium", 28_027_728), ("original", 93_600_848)])
def test_released_presets_have_released_parameter_counts(name, count):
    config = preset(name)
    assert sum(int(np.prod(s)) for s in expected_datasets(config).values()) == count
    # init builds the same model (plus the zero padding row of the shifted char embedding).
    shapes = jax.eval_shape(lambda: bilm.init(jax.random.PRNGKey(0), config))
    n = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    assert n - config.char_cnn.embedding_dim == count


def test_tiny_preset_matches_the_issue():
    c = PRESETS["tiny"]
    assert c.char_cnn.embedding_dim == 8
    assert c.char_cnn.filters == ((1, 16), (2, 16), (3, 32), (4, 64))
    assert (c.char_cnn.n_highway, c.lstm.projection_dim, c.lstm.dim, c.lstm.n_layers) == (1, 64, 256, 2)
    assert c.lstm.cell_clip == c.lstm.proj_clip == 3 and c.lstm.use_skip_connections


def test_configs_are_hashable_static_jit_arguments():
    a = Options.from_dict(json.loads((FIXTURES / "allennlp_elmo/options.json").read_text())).model
    b = Options.from_dict(json.loads((FIXTURES / "allennlp_elmo/options.json").read_text())).model
    assert a == b and hash(a) == hash(b)
    assert isinstance(a.char_cnn.filters, tuple) and isinstance(a.char_cnn.filters[0], tuple)
    traces = []
    g = jax.jit(lambda x, config: (traces.append(1), x * config.lstm.dim)[1], static_argnums=1)
    g(jnp.ones(2), a)
    g(jnp.ones(2), b)
    assert len(traces) == 1


def test_bilm_tf_training_options_get_bilm_tf_defaults():
    o = Options.from_dict(BILM_TF_TRAIN_OPTIONS)
    assert o.model.lstm.cell_clip is None and o.model.lstm.proj_clip is None
    assert o.model.lstm.use_skip_connections is False
    assert o.model.char_cnn.max_characters_per_token == 10
    assert o.train.learning_rate == 0.2 and o.train.n_tokens_vocab == 32
    # Written back out and read again: the same options.
    again = Options.from_dict(json.loads(json.dumps(o.to_dict())))
    assert again == o


def test_reference_options_round_trip_through_json(tmp_path):
    for d in ("allennlp_elmo", "bilm_tf_model"):
        o = Options.load(FIXTURES / d / "options.json")
        o.save(tmp_path / "o.json")
        assert Options.load(tmp_path / "o.json") == o
        assert json.loads((tmp_path / "o.json").read_text())["char_cnn"]["n_characters"] == 262


def test_defaults_missing_optional_keys():
    d = json.loads(json.dumps(BILM_TF_TRAIN_OPTIONS))
    del d["lstm"]["n_layers"], d["char_cnn"]["n_highway"]
    o = Options.from_dict(d)
    assert o.model.lstm.n_layers == 1 and o.model.char_cnn.n_highway == 0


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d.update(learning_rte=0.1), "unknown keys ['learning_rte']"),
        (lambda d: d["lstm"].update(projection=3), "lstm: unknown keys ['projection']"),
        (lambda d: d["char_cnn"].pop("activation"), "char_cnn: missing required key 'activation'"),
        (lambda d: d.pop("lstm"), "missing required key 'lstm'"),
        (
            lambda d: d["char_cnn"].update(activation="gelu"),
            "'activation' must be one of ('relu', 'tanh'), found 'gelu'",
        ),
        (lambda d: d["char_cnn"].update(n_characters=300), "'n_characters' must be 261"),
        (lambda d: d["lstm"].update(dim=0), "'dim' must be an integer >= 1, found 0"),
        (lambda d: d["lstm"].update(cell_clip=-1), "'cell_clip' must be a finite number >= 0"),
        (lambda d: d["lstm"].update(cell_clip=math.nan), "lstm: 'cell_clip' must be a finite number >= 0 or null"),
        (lambda d: d["lstm"].update(proj_clip=math.nan), "(0/null: no clipping), found nan"),
        (lambda d: d["lstm"].update(proj_clip=math.inf), "lstm: 'proj_clip' must be a finite number >= 0"),
        (
            lambda d: d["char_cnn"].update(filters=[[1, 8], [0, 8]]),
            "each filter must be two integers [width >= 1, count >= 1], found [0, 8]",
        ),
        (
            lambda d: d["char_cnn"].update(filters=[[1.7, 8]]),  # int() made it a width of 1
            "each filter must be two integers [width >= 1, count >= 1], found [1.7, 8]",
        ),
        (lambda d: d["char_cnn"].update(filters=[[1, "x"]]), "found [1, 'x']"),
        (lambda d: d.update(dropout="0.1"), "'dropout' must be a number, found '0.1'"),
        (lambda d: d.update(learning_rate=None), "'learning_rate' must be a number, found None"),
        (lambda d: d["lstm"].update(use_skip_connections="false"), "'use_skip_connections' must be true or false"),
        (lambda d: d.update(share_embedding_softmax="false"), "'share_embedding_softmax' must be true or false"),
        (
            lambda d: d["char_cnn"].update(max_characters_per_token=4),
            "filter width 5 exceeds max_characters_per_token 4",
        ),
        (lambda d: d.update(dropout=1.5), "'dropout' must be in [0, 1), found 1.5"),
        (lambda d: d.update(bidirectional=False), "bidirectional biLMs only"),
        (lambda d: d.update(sample_softmax=False), "'sample_softmax' must be true: elmo_jax trains with the sampled"),
        (lambda d: d.update(n_negative_samples_batch=64), "must be smaller than 'n_tokens_vocab' (32)"),
        (lambda d: d["lstm"].update(projection_dim=1000), "fewer than lstm.projection_dim 1000"),
        (lambda d: d["char_cnn"].update(embedding={"size": 4}), "'embedding' must be {\"dim\": N}"),
    ],
)
def test_bad_options_give_one_clear_error(tmp_path, mutate, message):
    d = json.loads(json.dumps(BILM_TF_TRAIN_OPTIONS))
    mutate(d)
    path = tmp_path / "options.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ConfigError) as e:
        Options.load(path)
    assert str(path) in str(e.value) and message in str(e.value)
    assert "\n" not in str(e.value)


def test_missing_and_malformed_options_files(tmp_path):
    with pytest.raises(ConfigError, match="options file not found"):
        Options.load(tmp_path / "nope.json")
    with pytest.raises(ConfigError, match=r": is a directory, not an options file$"):
        Options.load(tmp_path)
    bad = tmp_path / "bad.json"
    bad.write_text('{"lstm": {"dim": 4,\n "x": }')
    with pytest.raises(ConfigError, match=r"bad.json: not valid JSON \(line 2, column"):
        Options.load(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object, found list"):
        Options.load(bad)


def test_unknown_preset():
    with pytest.raises(ConfigError, match="unknown preset 'huge'"):
        preset("huge")


def test_a_sub_config_given_as_a_dict_is_refused_when_made():
    """(Before: taken, then an AttributeError such as 'dict' object has no attribute
    'projection_dim' wherever it was first read.)"""
    from elmo_jax.config import LSTMConfig

    for make, said in [
        (lambda: ModelConfig(lstm={"dim": 3}), "model: 'lstm' must be of type LSTMConfig, found dict"),
        (lambda: Options(model={"lstm": {}}), "options: 'model' must be of type ModelConfig, found dict"),
        (lambda: Options(train={"batch_size": 2}), "options: 'train' must be of type TrainConfig, found dict"),
    ]:
        with pytest.raises(ConfigError) as e:
            make()
        assert str(e.value) == said
    Options(model=ModelConfig(lstm=LSTMConfig()), train=None)


def test_train_config_validation():
    with pytest.raises(ConfigError, match="'batch_size' must be an integer >= 1"):
        TrainConfig(batch_size=0)
    assert dataclasses.replace(TrainConfig(), batch_size=4).batch_size == 4
    with pytest.raises(ConfigError):
        ModelConfig(
            char_cnn=PRESETS["tiny"].char_cnn, lstm=dataclasses.replace(PRESETS["tiny"].lstm, projection_dim=512)
        )


# -- reset_state_prob: the default recipe, and the files the references read ----------------------


def _bilm_tf_reads(d: dict) -> None:
    """The keys bilm-tf's LanguageModel and train() read from options.json, as they read them
    (``options[...]`` or ``.get``): a model of its reader; it never looks at any other key."""
    for k in (
        "n_tokens_vocab",
        "batch_size",
        "unroll_steps",
        "dropout",
        "n_negative_samples_batch",
        "all_clip_norm_val",
        "n_epochs",
        "n_train_tokens",
    ):
        assert isinstance(d[k], (int, float)) and not isinstance(d[k], bool), k
    d.get("bidirectional"), d.get("share_embedding_softmax"), d.get("sample_softmax"), d.get("learning_rate")
    lstm, cnn = d["lstm"], d["char_cnn"]
    lstm["dim"], lstm["projection_dim"], lstm.get("n_layers"), lstm.get("cell_clip"), lstm.get("proj_clip")
    cnn["filters"], cnn["max_characters_per_token"], cnn["embedding"]["dim"], cnn["activation"], cnn.get("n_highway")
    assert cnn["n_characters"] in (261, 262)  # 261 in bilm-tf's training graph, 262 at inference


def _allennlp_reads(d: dict) -> None:
    """The keys AllenNLP's _ElmoCharacterEncoder and _ElmoBiLm read: the two sections only."""
    cnn, lstm = d["char_cnn"], d["lstm"]
    cnn["filters"], cnn["n_highway"], cnn["embedding"]["dim"], cnn["activation"], cnn["max_characters_per_token"]
    lstm["projection_dim"], lstm["dim"], lstm["cell_clip"], lstm["proj_clip"], lstm.get("n_layers")
    assert lstm["use_skip_connections"] is True  # AllenNLP refuses false


def test_a_fresh_run_defaults_to_resets_and_a_saved_run_means_what_it_wrote():
    assert TrainConfig().reset_state_prob == 0.1
    d = json.loads(json.dumps(BILM_TF_TRAIN_OPTIONS))
    assert "reset_state_prob" not in d
    assert Options.from_dict(d).train.reset_state_prob == 0.1  # a bilm-tf file starts a run at the default
    # A run's own record without the key was written before the default, at bilm-tf's 0.0.
    assert Options.from_dict(d, saved=True).train.reset_state_prob == 0.0
    assert Options.from_dict({**d, "reset_state_prob": 0.3}, saved=True).train.reset_state_prob == 0.3
    assert Options.from_dict({**d, "reset_state_prob": 0.0}).train.reset_state_prob == 0.0
    # The key is always written, 0.0 included, so a file read back means what it meant.
    for prob in (0.0, 0.1):
        o = Options.from_dict({**d, "reset_state_prob": prob})
        assert o.to_dict()["reset_state_prob"] == prob
        assert Options.from_dict(json.loads(json.dumps(o.to_dict())), saved=True) == o
        assert Options.from_dict(json.loads(json.dumps(o.to_dict()))) == o
    assert "reset_state_prob" not in Options(model=PRESETS["tiny"]).to_dict()  # no training keys, no key
    with pytest.raises(
        ConfigError, match=r"no training keys .*; give them one: Options\(model=\.\.\., train=TrainConfig\("
    ):
        _ = Options(model=PRESETS["tiny"]).training  # what pretrain reads


def test_rows_per_draw_divides_the_rows_and_is_written_only_when_set(tmp_path):
    assert TrainConfig().draws_per_device == 1
    assert TrainConfig(batch_size=384, rows_per_draw=128).draws_per_device == 3
    assert TrainConfig(batch_size=384, rows_per_draw=384).draws_per_device == 1
    for bad, message in ((100, r"'rows_per_draw' \(100\) must divide 'batch_size' \(384\)"), (-1, ">= 0")):
        with pytest.raises(ConfigError, match=message):
            TrainConfig(batch_size=384, rows_per_draw=bad)
    d = json.loads(json.dumps(BILM_TF_TRAIN_OPTIONS))
    assert Options.from_dict(d).train.rows_per_draw == 0  # bilm-tf's file, or a run of ours before the key
    o = Options.from_dict({**d, "batch_size": 384, "rows_per_draw": 128})
    o.save(tmp_path / "options.json")
    assert Options.load(tmp_path / "options.json", saved=True).train == o.train
    assert "rows_per_draw" not in Options.from_dict(d).to_dict()  # the default: the file as before


def test_an_override_that_breaks_the_recipe_names_its_argument():
    from elmo_jax._util.arguments import arguments_of
    from elmo_jax.model.vocabulary import Vocabulary
    from elmo_jax.training.setup import training_options

    vocab = Vocabulary(["<S>", "</S>", "<UNK>"] + [f"w{i}" for i in range(2000)])
    assert training_options("small", vocab, 384, 10_000, rows_per_draw=128).train.draws_per_device == 3
    with pytest.raises(ConfigError, match="'rows_per_draw' \\(100\\) must divide") as e:
        training_options("small", vocab, 384, 10_000, rows_per_draw=100)
    assert set(arguments_of(e.value)) == {"batch_size", "rows_per_draw"}


def test_init_from_and_presets_start_at_the_default():
    from elmo_jax.model.vocabulary import Vocabulary
    from elmo_jax.training.setup import training_options

    vocab = Vocabulary(["<S>", "</S>", "<UNK>"] + [f"w{i}" for i in range(2000)])
    for config, model in (("tiny", None), ("small", None), (None, PRESETS["tiny"])):  # None: --init-from
        options = training_options(config, vocab, None, 10_000, model=model)
        assert options.train.reset_state_prob == 0.1, config
    options = training_options(None, vocab, None, 10_000, reset_state_prob=0.0, model=PRESETS["tiny"])
    assert options.train.reset_state_prob == 0.0


def test_written_training_options_are_read_by_bilm_tf_and_allennlp(tmp_path):
    o = Options(model=PRESETS["tiny"], train=TrainConfig(n_tokens_vocab=1000, n_negative_samples_batch=64))
    o.save(tmp_path / "options.json")
    written = json.loads((tmp_path / "options.json").read_text())
    assert written["reset_state_prob"] == 0.1
    _bilm_tf_reads(written)
    _allennlp_reads(written)
    # What bilm-tf has no key for: the one top-level key of ours.
    bilm_tf_keys = {
        "lstm",
        "char_cnn",
        "n_tokens_vocab",
        "batch_size",
        "unroll_steps",
        "n_negative_samples_batch",
        "dropout",
        "all_clip_norm_val",
        "n_epochs",
        "n_train_tokens",
        "bidirectional",
        "learning_rate",
        "sample_softmax",
        "share_embedding_softmax",
    }
    assert set(written) - bilm_tf_keys == {"reset_state_prob"}
    # Negative controls: the reader models do fail on a file they could not read.
    for reads, broken in (
        (_bilm_tf_reads, {k: v for k, v in written.items() if k != "unroll_steps"}),
        (_allennlp_reads, {**written, "lstm": {k: v for k, v in written["lstm"].items() if k != "proj_clip"}}),
    ):
        with pytest.raises(KeyError):
            reads(broken)
    _allennlp_reads(json.loads((FIXTURES / "allennlp_elmo" / "options.json").read_text()))  # the model fits


def test_a_mistyped_name_is_refused_with_the_nearest_one(monkeypatch, tmp_path):
    """Presets, released models (as a model, or as --init-from's source) and train's config: a name
    one letter off is answered with the name meant; a name near none of them, without a guess."""
    from elmo_jax.pretrained.registry import PretrainedError, get_model
    from elmo_jax.training.setup import _options_file
    from elmo_jax.training.warmstart import CheckpointError, read_warmstart

    monkeypatch.chdir(tmp_path)  # where no file is named like the typos
    cases = [
        (lambda name: preset(name), ConfigError, "smal", "small"),
        (lambda name: get_model(name), PretrainedError, "orignal", "original"),
        (lambda name: _options_file(name), ConfigError, "tinny", "tiny"),
        (lambda name: read_warmstart(name), CheckpointError, "orignal", "original"),
    ]
    for call, error, typo, meant in cases:
        with pytest.raises(error) as e:
            call(typo)
        assert str(e.value).endswith(f"; did you mean {meant}?"), e.value
        with pytest.raises(error) as e:  # negative control: nothing near
            call("xyzzy")
        assert "did you mean" not in str(e.value), e.value


def test_one_str_for_many_sentences_is_named():
    """A str is a sequence of letters: taken as sentences, "the cat" was 7 one-letter sentences."""
    from elmo_jax.model.vocabulary import batch_to_ids

    with pytest.raises(TypeError, match=r"^sentences is one str \('the cat'\); expected a list of sentences"):
        batch_to_ids("the cat")
    assert batch_to_ids(["the cat".split()]).shape == (1, 2, 50)  # negative control


def test_numpy_numbers_of_a_sweep_are_kept_as_python_numbers_and_saved(tmp_path):
    """(Before: ``LSTMConfig(dim=np.int64(64))`` passed its checks, and then ``Options.save``
    failed with json's "Object of type int64 is not JSON serializable", writing nothing.)"""
    base = preset("tiny")
    lstm = dataclasses.replace(base.lstm, dim=np.int64(64), projection_dim=np.int32(32), cell_clip=np.float32(3))
    cnn = dataclasses.replace(base.char_cnn, embedding_dim=np.int64(4), filters=((1, np.int64(32)),))
    train = TrainConfig(
        n_tokens_vocab=np.int64(100), n_negative_samples_batch=np.int64(8), learning_rate=np.float32(0.5)
    )
    options = Options(model=ModelConfig(char_cnn=cnn, lstm=lstm), train=train)
    assert type(lstm.dim) is int and type(lstm.cell_clip) is float and type(train.learning_rate) is float
    assert lstm == dataclasses.replace(base.lstm, dim=64, projection_dim=32, cell_clip=3.0)
    options.save(tmp_path / "options.json")
    assert Options.load(tmp_path / "options.json") == options
    assert json.loads((tmp_path / "options.json").read_text())["lstm"]["dim"] == 64
