"""A run dir on an object store (``gs://``): every run-dir file goes through ``etils.epath``, and
neither rename nor append (which GCS lacks) is used.

``etils.epath.testing.mock_epath`` swaps every epath backend for a local one whose functions we
wrap; a ``gs://bucket/run`` path then lands, through it, in ``<cwd>/gs:/bucket/run``, so each test
runs in its own ``tmp_path``. Rename, replace and append raise there, and also through ``os`` and
``open`` for a ``gs:`` path, so a write that bypassed epath (treating the URI as a local name) fails
too. Orbax needs no exemption: for a ``gs://`` path it commits a step with ``commit_success.txt``
files, not a rename (``orbax.checkpoint._src.path.atomicity_defaults``). Two GCS specifics of
Orbax that bypass epath are redirected: TensorStore's native ``gcs`` driver (to its ``file``
driver at the same local place) and the bucket's hierarchical-namespace query (no).
"""

import builtins
import contextlib
import json
import os
import pathlib

import pytest
from etils import epath
from etils.epath import testing as epath_testing
from orbax.checkpoint._src.path import gcs_utils
from test_pretrain import TRAIN, assert_export_holds, bilm_tf_options

from elmo_jax._util.atomic import is_local
from elmo_jax.model.vocabulary import Vocabulary
from elmo_jax.text.sources import TextFiles
from elmo_jax.training.hooks import MetricsFile
from elmo_jax.training.loop import RunSettings, options_for_vocab, pretrain
from elmo_jax.training.run_dir import export_run, load_run

RUN = "gs://bucket/run"


def _no_gcs(what):
    def refuse(*args, **kwargs):
        raise OSError(f"{what}: GCS has no such operation ({args[1:]})")

    return refuse


@contextlib.contextmanager
def gcs_like(monkeypatch, tmp_path):
    """A mock GCS under ``tmp_path``: yields the list of (path, mode) opened through epath."""
    monkeypatch.chdir(tmp_path)
    opened = []

    def open_(original, path, mode):
        opened.append((os.fspath(path), mode))
        if "a" in mode or "+" in mode:
            raise OSError(f"{path}: GCS has no append (mode {mode!r})")
        return original(path, mode)

    real_open, real_replace, real_rename = builtins.open, os.replace, os.rename

    def on_gcs(path) -> bool:
        return isinstance(path, (str, os.PathLike)) and os.fsdecode(path).startswith("gs:")

    def os_open(file, mode="r", *args, **kwargs):
        if on_gcs(file) and ("a" in mode or "+" in mode):
            raise OSError(f"{file}: append on a gs: path")
        return real_open(file, mode, *args, **kwargs)

    def os_move(real):
        def move(src, dst, *args, **kwargs):
            if on_gcs(src) or on_gcs(dst):
                raise OSError(f"rename {src} -> {dst} on a gs: path")
            return real(src, dst, *args, **kwargs)

        return move

    monkeypatch.setattr(builtins, "open", os_open)
    monkeypatch.setattr(os, "replace", os_move(real_replace))
    monkeypatch.setattr(os, "rename", os_move(real_rename))
    # Orbax's GCS specifics outside epath (see the module docstring).
    monkeypatch.setattr(gcs_utils, "is_hierarchical_namespace_enabled", lambda path: False)
    monkeypatch.setattr(
        gcs_utils, "get_kvstore_for_gcs", lambda path: {"driver": "file", "path": os.path.abspath(path)}
    )
    with epath_testing.mock_epath(open=open_, rename=_no_gcs("rename"), replace=_no_gcs("replace")):
        yield opened


def test_is_local():
    assert not is_local("gs://bucket/run") and not is_local(epath.Path("gs://bucket/run"))
    assert not is_local("s3://b/x")
    assert is_local("run") and is_local("/tmp/run") and is_local(pathlib.Path("/tmp/gs:/x"))
    assert is_local(epath.Path("/tmp/run"))


@pytest.mark.slow
def test_pretrain_resume_load_and_export_on_gcs(monkeypatch, tmp_path, capsys):
    vocab = Vocabulary.load(TRAIN.resolve() / "vocab.txt")
    options = options_for_vocab(bilm_tf_options(batch_size=2, unroll_steps=5), vocab, None)
    source = TextFiles(str(TRAIN.resolve() / "data.txt"))
    local = tmp_path / "gs:" / "bucket"
    with gcs_like(monkeypatch, tmp_path) as opened:
        pretrain(
            options,
            vocab,
            source,
            RunSettings(run_dir=RUN, steps=4, save_every=2, log_every=1, keep=2, progress=False, devices=1),
        )
        metrics = epath.Path(RUN) / "metrics.jsonl"
        first = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert [m["step"] for m in first] == [1, 2, 3, 4]
        # As if steps 5 and 6 had been logged before a crash that lost their checkpoint: resumed
        # from step 4 they run again and are logged once, anew.
        metrics.write_text(metrics.read_text() + '{"step": 5, "loss": -1}\n{"step": 6, "loss": -1}\n')
        last = pretrain(
            options,
            vocab,
            source,
            RunSettings(run_dir=RUN, steps=6, save_every=2, log_every=1, keep=2, progress=False, devices=1),
        )
        assert "resuming gs://bucket/run from step 4" in capsys.readouterr().out
        again = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert again[:4] == first and [m["step"] for m in again] == [1, 2, 3, 4, 5, 6]
        assert all(m["loss"] > 0 for m in again) and last["step"] == 6

        _, _, params, step = load_run(RUN)
        assert step == 6
        from elmo_jax.training.setup import saved_steps

        assert saved_steps(RUN) == [4, 6]  # Orbax's own commit files, as saved_steps looks for them
        paths = export_run(RUN, "gs://bucket/export").paths
        assert paths[0] == "gs://bucket/export/options.json"

    written = {p for p, mode in opened if "w" in mode}
    for name in ("options.json", "vocab.txt", "metrics.jsonl", "host_state/2.p0.npz", "host_state/6.p0.npz"):
        assert f"{RUN}/{name}" in written, name
    assert {f"gs://bucket/export/{n}" for n in ("options.json", "weights.hdf5", "softmax.hdf5", "vocab.txt")} <= written
    assert sorted(p.name for p in (local / "run" / "host_state").iterdir()) == ["4.p0.npz", "6.p0.npz"]  # 2 pruned
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp" in p.name]
    assert not leftovers, leftovers
    # The export is complete and holds the run's weights.
    assert_export_holds(local / "export", params, options.model)
    assert Vocabulary.load(local / "export/vocab.txt").words == vocab.words


@pytest.mark.parametrize("where", ["local", "gcs"])
def test_metrics_file_drops_later_steps_and_keeps_everything_else(monkeypatch, tmp_path, where):
    lines = [b'{"step": 1}', b"not json \xff", b'{"step": 3}', b"[1, 2]", b'{"step": 2, "x": 0}']
    old = b"\n".join(lines)  # the last line torn (no newline): a crash mid-append
    with contextlib.ExitStack() as stack:
        if where == "gcs":
            stack.enter_context(gcs_like(monkeypatch, tmp_path))
            path, local = "gs://bucket/run/metrics.jsonl", tmp_path / "gs:/bucket/run/metrics.jsonl"
        else:
            path = local = tmp_path / "metrics.jsonl"
        local.parent.mkdir(parents=True, exist_ok=True)
        local.write_bytes(old)
        m = MetricsFile(os.fspath(path), start=2)
        assert local.read_bytes() == b"".join(line + b"\n" for line in lines if line != b'{"step": 3}')
        m.add({"step": 3})
        m.add({"step": 4})
        assert local.read_bytes().endswith(b'{"step": 2, "x": 0}\n{"step": 3}\n{"step": 4}\n')
        # Nothing to drop and no torn line: the file is left as it is.
        before = local.stat().st_mtime_ns
        MetricsFile(os.fspath(path), start=4)
        assert local.stat().st_mtime_ns == before


def test_a_step_orbax_has_not_committed_on_gcs_is_not_a_saved_step(monkeypatch, tmp_path):
    """On an object store Orbax writes into checkpoints/<step>/ and commits it with
    commit_success.txt: a step without it is a save cut short (before: counted as saved, so
    --init-from was skipped and a stopped run named it as intact). Locally the step's name is the
    commit (a rename of a temporary directory)."""
    from elmo_jax.training.setup import saved_steps

    with gcs_like(monkeypatch, tmp_path):
        for step, committed in ((2, True), (4, False)):
            d = epath.Path(RUN, "checkpoints", str(step))
            d.mkdir(parents=True)
            if committed:
                (d / "commit_success.txt").write_text("")
        assert saved_steps(RUN) == [2]
    local = tmp_path / "local"
    (local / "checkpoints" / "4").mkdir(parents=True)
    (local / "checkpoints" / "6.orbax-checkpoint-tmp-1").mkdir()
    assert saved_steps(str(local)) == [4]
