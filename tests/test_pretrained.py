"""elmo_jax.pretrained: the registry, and downloads from a local server standing in for AllenNLP's storage."""

import dataclasses
import hashlib
import json
import os
import pathlib
import re
import subprocess
import sys

import numpy as np
import pytest
from model_server import HTML_PAGE, ModelServer, fixture_files, fixture_model, fixture_tree, serve_fixture

from elmo_jax import cli
from elmo_jax._util.arguments import arguments_of
from elmo_jax.pretrained import registry
from elmo_jax.pretrained.registry import DownloadFailed, PretrainedError

OPTIONS = registry.MODELS["original"].files["options"][0].local
WEIGHTS = registry.MODELS["original"].files["weights"][0].local
FIXTURE = fixture_files()
RELEASED = dict(registry.MODELS)  # before the autouse fixture swaps the fixture model in


@pytest.fixture(autouse=True)
def isolated(monkeypatch, tmp_path):
    """A fresh cache per test, the fixture model registered as ``original``, no real network."""
    for var in ("ELMO_JAX_MIRROR", "ELMO_JAX_OFFLINE", "ELMO_JAX_SHA256"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("ELMO_JAX_HOME", str(tmp_path / "cache"))
    monkeypatch.setitem(registry.MODELS, "original", fixture_model("original"))
    monkeypatch.setattr(registry, "RETRY_WAIT_S", 0.0)


def model_dir(tmp_path) -> pathlib.Path:
    return tmp_path / "cache" / "original"


def leftovers(tmp_path) -> list[str]:
    """Data files in the model's cache directory (the lock file and manifest aside)."""
    files = model_dir(tmp_path).rglob("*")  # nothing when the directory does not exist
    return sorted(p.name for p in files if p.is_file() and p.name not in (".lock", "manifest.json"))


def same_bytes(path, role="weights") -> bool:
    return pathlib.Path(path).read_bytes() == FIXTURE[role].read_bytes()


def test_registry_entries_are_complete():
    for name, model in RELEASED.items():
        assert {"options", "weights"} <= set(model.files) <= set(registry.ROLES), name
        locals_ = [f.local for files in model.files.values() for f in files]
        assert len(set(locals_)) == len(locals_), name  # one cache directory per model, no clashes
        assert all(not f.path.startswith(("/", "http")) for files in model.files.values() for f in files)
    original = RELEASED["original"].files
    assert (original["options"][0].size, original["weights"][0].size) == (336, 374_434_792)
    assert original["weights"][0].path == (
        "2x4096_512_2048cnn_2xhighway/elmo_2x4096_512_2048cnn_2xhighway_weights.hdf5"
    )


def test_fresh_download_loads_the_fixture(tmp_path, monkeypatch):
    import jax

    from elmo_jax.compat.hdf5 import load_hdf5

    with serve_fixture(tmp_path) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        config, params = registry.load_pretrained("original", progress=False)
        assert [r["path"] for r in server.gets()] == [
            "/" + registry.MODELS["original"].files[r][0].path for r in ("options", "weights")
        ]
    want_config, want_params = load_hdf5(FIXTURE["options"], FIXTURE["weights"])
    assert config == want_config
    assert jax.tree_util.tree_structure(params) == jax.tree_util.tree_structure(want_params)
    for a, b in zip(jax.tree_util.tree_leaves(params), jax.tree_util.tree_leaves(want_params)):
        np.testing.assert_array_equal(a, b)
    assert leftovers(tmp_path) == sorted([OPTIONS, WEIGHTS])  # no .part left
    manifest = json.loads((model_dir(tmp_path) / "manifest.json").read_text())["files"]
    assert manifest[WEIGHTS]["sha256"] == hashlib.sha256(FIXTURE["weights"].read_bytes()).hexdigest()
    assert manifest[WEIGHTS]["size"] == FIXTURE["weights"].stat().st_size


def test_cut_transfer_is_resumed_with_range(tmp_path, monkeypatch):
    with serve_fixture(tmp_path, cut_after=100_000, cut_path="weights") as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        paths = registry.fetch("original", progress=False)
        gets = server.gets("weights")
    assert [g["range"] for g in gets] == [None, "bytes=100000-"]
    assert same_bytes(paths["weights"])


def test_broken_transfer_keeps_the_part_and_the_next_run_resumes(tmp_path, monkeypatch):
    with serve_fixture(tmp_path, cut_after=100_000, cut_path="weights", cut_times=registry.ATTEMPTS) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        with pytest.raises(PretrainedError, match="run again to resume") as e:
            registry.fetch("original", progress=False)
        assert "\n" not in str(e.value) and type(e.value) is DownloadFailed  # the public type, not the retry's
        part = model_dir(tmp_path) / (WEIGHTS + ".part")
        assert part.stat().st_size == 100_000 * registry.ATTEMPTS
        assert not (model_dir(tmp_path) / WEIGHTS).exists()
        paths = registry.fetch("original", progress=False)
        assert server.gets("weights")[-1]["range"] == f"bytes={100_000 * registry.ATTEMPTS}-"
    assert same_bytes(paths["weights"]) and not part.exists()


def test_a_server_error_is_retried_and_one_that_lasts_exits_1_as_the_network_not_the_input(
    tmp_path, monkeypatch, capsys
):
    with serve_fixture(tmp_path, error=503, error_times=registry.ATTEMPTS - 1) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        paths = registry.fetch("original", progress=False)  # the first file's tries use up the errors
    assert same_bytes(paths["weights"]) and same_bytes(paths["options"], "options")

    # Every try answered 503: the network's failure, exit 1 (a retry may work), not 2 (fix the input).
    with serve_fixture(tmp_path / "again", error=503, error_times=registry.ATTEMPTS) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        monkeypatch.setenv("ELMO_JAX_HOME", str(tmp_path / "cache2"))
        assert cli.main(["models", "--fetch", "original", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert (
        err.startswith("elmo-jax models: error: ") and "HTTP 503" in err and f"after {registry.ATTEMPTS} tries" in err
    )
    assert err.count("\n") == 1

    # The control: a 404 is the input's (the mirror's) fault, exit 2, and is not retried.
    with serve_fixture(tmp_path / "third", error=404, error_times=registry.ATTEMPTS) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        monkeypatch.setenv("ELMO_JAX_HOME", str(tmp_path / "cache3"))
        assert cli.main(["models", "--fetch", "original", "--no-progress"]) == 2
        assert len(server.gets()) == 1
    assert "HTTP 404" in capsys.readouterr().err


def test_server_ignoring_range_restarts_from_zero(tmp_path, monkeypatch):
    d = model_dir(tmp_path)
    d.mkdir(parents=True)
    stale = b"\x89HDF stale bytes that are no prefix of the file" * 20
    (d / (WEIGHTS + ".part")).write_bytes(stale)
    with serve_fixture(tmp_path, ignore_range=True) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        paths = registry.fetch("original", progress=False)
        assert [g["range"] for g in server.gets("weights")] == [f"bytes={len(stale)}-"]  # asked to resume, got 200
    assert same_bytes(paths["weights"])  # replaced, never appended to


def test_wrong_size_is_refused_and_nothing_is_kept(tmp_path, monkeypatch):
    model = fixture_model("original")
    wrong = {**model.files, "weights": (dataclasses.replace(model.files["weights"][0], size=123),)}
    monkeypatch.setitem(registry.MODELS, "original", dataclasses.replace(model, files=wrong))
    with serve_fixture(tmp_path) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        with pytest.raises(PretrainedError, match=f"has {FIXTURE['weights'].stat().st_size} bytes.*has 123"):
            registry.fetch("original", progress=False)
    assert leftovers(tmp_path) == [OPTIONS]


def test_cached_file_of_wrong_size_is_refused(tmp_path):
    d = model_dir(tmp_path)
    d.mkdir(parents=True)
    (d / OPTIONS).write_bytes(FIXTURE["options"].read_bytes())
    (d / WEIGHTS).write_bytes(FIXTURE["weights"].read_bytes()[:1000])
    with pytest.raises(PretrainedError, match=f"{WEIGHTS}: 1000 bytes.*delete it"):
        registry.fetch("original", progress=False)


def test_pinned_sha256(tmp_path, monkeypatch):
    good = hashlib.sha256(FIXTURE["weights"].read_bytes()).hexdigest()
    with serve_fixture(tmp_path) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        with pytest.raises(PretrainedError, match=f"sha256 {good}, but 0+ is pinned"):
            registry.fetch("original", progress=False, sha256={"weights": "0" * 64})
        assert leftovers(tmp_path) == [OPTIONS]
        paths = registry.fetch("original", progress=False, sha256={"weights": good.upper()})
    assert same_bytes(paths["weights"])
    # A pin from the environment is checked against the cached file's recorded hash.
    monkeypatch.setenv("ELMO_JAX_SHA256", f"original:{WEIGHTS}={'1' * 64}")
    with pytest.raises(PretrainedError, match="is pinned; delete it"):
        registry.fetch("original", progress=False)
    # Each says where the bad pin came from (before: "original: the sha256 pinned for 'weights'" alone).
    with pytest.raises(
        PretrainedError, match=r"^sha256: the sha256 pinned for original's 'weights' is not 64 hex digits$"
    ):
        registry.fetch("original", sha256={"weights": "abc"})
    monkeypatch.setenv("ELMO_JAX_SHA256", "original:weights=zz")
    with pytest.raises(PretrainedError) as e:
        registry.fetch("original", progress=False)
    assert str(e.value) == "ELMO_JAX_SHA256: the sha256 pinned for original's 'weights' is not 64 hex digits"


def test_offline_missing_file_says_where_to_put_it(tmp_path, monkeypatch):
    monkeypatch.setenv("ELMO_JAX_OFFLINE", "1")
    with pytest.raises(PretrainedError) as e:
        registry.fetch("original", progress=False)
    msg = str(e.value)
    assert "\n" not in msg and "ELMO_JAX_OFFLINE" in msg
    assert f"put it at {model_dir(tmp_path) / OPTIONS}" in msg
    assert registry.BASE_URL + registry.MODELS["original"].files["options"][0].path in msg
    assert not (tmp_path / "cache").exists()  # offline creates nothing


def test_offline_uses_files_put_there_by_hand(tmp_path, monkeypatch):
    monkeypatch.setenv("ELMO_JAX_OFFLINE", "1")
    monkeypatch.setenv("ELMO_JAX_MIRROR", "http://127.0.0.1:9/")  # nothing listens: any request would fail
    d = model_dir(tmp_path)
    d.mkdir(parents=True)
    for role, name in (("options", OPTIONS), ("weights", WEIGHTS)):
        (d / name).write_bytes(FIXTURE[role].read_bytes())
    paths = registry.fetch("original", progress=False)
    assert paths == {"options": d / OPTIONS, "weights": d / WEIGHTS}
    assert registry.verify("original")[WEIGHTS] == hashlib.sha256(FIXTURE["weights"].read_bytes()).hexdigest()


@pytest.mark.parametrize("as_url", [False, True])
def test_local_directory_mirror(tmp_path, monkeypatch, as_url):
    mirror = fixture_tree(tmp_path / "mirror")
    monkeypatch.setenv("ELMO_JAX_MIRROR", mirror.as_uri() if as_url else str(mirror))
    paths = registry.fetch("original", progress=False)
    assert same_bytes(paths["weights"]) and same_bytes(paths["options"], "options")
    monkeypatch.setenv("ELMO_JAX_MIRROR", str(tmp_path / "empty"))
    with pytest.raises(PretrainedError, match="mirror: .* not found"):
        registry.fetch("small", progress=False)


CHILD = r"""
import json, sys, types
pkg = types.ModuleType("elmo_jax")  # the package's __init__ would import jax; pretrained needs none
pkg.__path__ = [sys.argv[1]]
sys.modules["elmo_jax"] = pkg
sys.path.insert(0, sys.argv[2])
from model_server import fixture_model
from elmo_jax import pretrained
assert "jax" not in sys.modules
model = fixture_model("original")
print("ready", flush=True)
sys.stdin.readline()
paths = pretrained.fetch(model, progress=False)
print(json.dumps({k: str(v) for k, v in paths.items()}))
"""


def test_two_processes_download_once(tmp_path, monkeypatch):
    with serve_fixture(tmp_path, pause_s=1.0, pause_path="weights") as server:
        env = {**os.environ, "ELMO_JAX_MIRROR": server.url}
        args = [
            sys.executable,
            "-c",
            CHILD,
            str(pathlib.Path(registry.__file__).parents[1]),
            str(pathlib.Path(__file__).parent),
        ]
        procs = [
            subprocess.Popen(args, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)
        ]
        for p in procs:  # both imported: start them together, so one waits on the other's lock
            assert p.stdout.readline().strip() == "ready"
        for p in procs:
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=60)[0] for p in procs]
        assert [p.returncode for p in procs] == [0, 0]
        assert len(server.gets("weights")) == 1
    paths = [json.loads(o.strip().splitlines()[-1]) for o in outs]
    assert paths[0] == paths[1] and same_bytes(paths[0]["weights"])


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(
        PretrainedError, match="unknown model 'large'; known models: small, medium, original, original_5.5b, pubmed"
    ):
        registry.fetch("large")
    with pytest.raises(PretrainedError, match="pubmed: no 'softmax' file was released; it has options, weights"):
        registry.fetch("pubmed", ("softmax",))


def test_cache_under_a_regular_file(tmp_path, monkeypatch):
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("ELMO_JAX_HOME", str(tmp_path / "afile" / "models"))
    monkeypatch.setenv("ELMO_JAX_MIRROR", str(fixture_tree(tmp_path / "mirror")))
    with pytest.raises(PretrainedError) as e:
        registry.fetch("original", progress=False)
    assert str(e.value) == (
        f"ELMO_JAX_HOME={tmp_path / 'afile' / 'models'}: {tmp_path / 'afile'} is a file, not a directory; "
        "set ELMO_JAX_HOME to a directory"
    )


@pytest.mark.parametrize("where", ["afile", "afile/models"])
def test_a_cache_dir_where_a_file_is_is_refused_by_every_use_of_the_cache(tmp_path, monkeypatch, where):
    """Not listed as a cache with nothing in it, nor named as where to put a file when offline
    (both before): each use names the argument, and makes nothing."""
    (tmp_path / "afile").write_text("x")
    monkeypatch.setenv("ELMO_JAX_OFFLINE", "1")
    cache_dir = tmp_path / where
    said = (
        f"cache_dir {cache_dir}: "
        + ("" if where == "afile" else f"{tmp_path / 'afile'} ")
        + "is a file, not a directory"
    )
    for use in (registry.cache_status, lambda cache_dir: registry.fetch("original", cache_dir=cache_dir)):
        with pytest.raises(PretrainedError) as e:
            use(cache_dir=cache_dir)
        assert str(e.value) == said and arguments_of(e.value) == ("cache_dir",)
    with pytest.raises(PretrainedError, match=re.escape(said)):
        registry.verify("original", cache_dir=cache_dir)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]
    # A cache directory that is not there yet is an empty cache, and is not made by a listing.
    rows = registry.cache_status(cache_dir=tmp_path / "new")
    assert rows and {r.state for r in rows} == {"missing"}
    assert not (tmp_path / "new").exists()


def test_404_mirror_is_refused(tmp_path, monkeypatch):
    (tmp_path / "empty").mkdir()
    with ModelServer(tmp_path / "empty") as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        with pytest.raises(PretrainedError, match=r"HTTP 404 .*original's " + OPTIONS):
            registry.fetch("original", progress=False)
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("page_type", ["text/html; charset=utf-8", "application/octet-stream"])
def test_html_page_mirror_is_refused(tmp_path, monkeypatch, page_type):
    with ModelServer(tmp_path, page=HTML_PAGE, page_type=page_type) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        with pytest.raises(PretrainedError, match="HTML page") as e:
            registry.fetch("original", progress=False)
    assert "\n" not in str(e.value)
    assert leftovers(tmp_path) == []


def test_models_command(tmp_path, monkeypatch, capsys):
    assert cli.main(["models", "--verify"]) == 0  # an empty cache: said, where it printed nothing
    assert capsys.readouterr().out.endswith(
        "\nno file is cached, so none was checked; elmo-jax models --fetch NAME downloads a model\n"
    )
    with serve_fixture(tmp_path) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        assert cli.main(["models", "--fetch", "original", "--no-progress"]) == 0
    assert f"weights: {model_dir(tmp_path) / WEIGHTS}" in capsys.readouterr().out

    assert cli.main(["models"]) == 0
    out = capsys.readouterr().out
    assert f"cache: {tmp_path / 'cache'}" in out
    for name in registry.MODELS:
        assert f"\n{name}: " in out
    assert "original_5.5b: 93.6M parameters; LSTM 4096/512, 2 highway layers; SRL F1 84.93" in out
    lines = {line.split()[1]: line for line in out.splitlines() if line.startswith("  ")}
    assert lines[WEIGHTS].split()[-2:] == [f"{FIXTURE['weights'].stat().st_size:,}", "cached"]

    assert cli.main(["models", "--verify"]) == 0
    out = capsys.readouterr().out
    assert "original: 2 cached file(s) match their sha256" in out and "none was checked" not in out

    weights = model_dir(tmp_path) / WEIGHTS
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # same size, other bytes: only the hash can tell
    weights.write_bytes(bytes(data))
    assert cli.main(["models", "--verify"]) == 2
    captured = capsys.readouterr()
    assert f"original: FAILED: {weights}: sha256" in captured.out
    assert captured.err == "elmo-jax models: error: 1 model(s) failed verification\n"

    assert cli.main(["models", "--fetch", "nope"]) == 2
    assert capsys.readouterr().err.startswith("elmo-jax models: error: unknown model 'nope'; known models: small")


def test_every_entry_point_loads_a_released_model_by_name(tmp_path, monkeypatch):
    """``Embedder``/``Elmo``/``ElmoNNX.from_pretrained`` and ``elmo-jax embed --model``: the same
    vectors as the files read directly; the download happens once, later loads are offline."""
    import h5py
    from flax import nnx

    from elmo_jax import Elmo, ElmoNNX, Embedder

    sentences = [["The", "apple", "fell", "."], ["Apple", "shares", "rose"]]
    want = Embedder.from_hdf5(FIXTURE["options"], FIXTURE["weights"]).embed(sentences)
    with serve_fixture(tmp_path) as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        got = Embedder.from_pretrained("original").embed(sentences)
        assert len(server.gets()) == 2
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    monkeypatch.setenv("ELMO_JAX_OFFLINE", "1")  # the server is gone: the cache must do
    elmo, bilm = Elmo.from_pretrained("original", dropout=0.0)
    assert elmo.config == Embedder.from_hdf5(FIXTURE["options"], FIXTURE["weights"]).config
    assert ElmoNNX.from_pretrained("original", rngs=nnx.Rngs(0)).config == elmo.config
    text = tmp_path / "in.txt"
    text.write_text("\n".join(" ".join(s) for s in sentences) + "\n")
    out = tmp_path / "out.hdf5"
    assert (
        cli.main(
            [
                "--compile-cache",
                "none",
                "embed",
                "--model",
                "original",
                "--input",
                str(text),
                "--output",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    with h5py.File(out, "r") as f:
        for i, b in enumerate(want):
            np.testing.assert_array_equal(f[str(i)][()], b)
