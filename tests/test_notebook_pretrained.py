"""experiments/colab_pretrained.ipynb runs top to bottom against a local stand-in for AllenNLP's storage.

On Colab the notebook downloads the released ``original`` model (~375 MB). Here the fixture biLM stands in
for it: ``model_server.serve_fixture`` serves the fixture files under ``original``'s released paths on
127.0.0.1, ``ELMO_JAX_MIRROR`` points the kernel there and ``ELMO_JAX_HOME`` at ``tmp_path``. The fixture's
file sizes are not the sizes pinned for ``original`` in the registry, so the test runs one extra cell of
its own first, in the kernel: it puts ``model_server.fixture_model("original")`` (the same entry, sized as
the fixture files) into ``pretrained.MODELS``. That cell exists only in the test's in-memory copy; the
stored notebook is exactly what a Colab user runs.

The kernel is this interpreter (a "python3" kernelspec first on ``JUPYTER_PATH``, as in
test_notebook.py) and inherits this process's environment, conftest's settings included (two CPU
devices, the session's compile cache). The fixture's numbers are meaningless, so the test checks that
every cell ran and printed its results, not what they are.
"""

import json
import os
import pathlib
import re
import sys

import pytest
from model_server import serve_fixture
from test_notebook import _text, _this_interpreter_kernelspec, read_notebook, stored_code_cells

from elmo_jax import pretrained

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "colab_pretrained.ipynb"
TESTS = pathlib.Path(__file__).resolve().parent

# Run in the kernel before the notebook's first cell (never stored in the notebook).
SETUP_CELL = f"""\
import sys
sys.path.insert(0, {str(TESTS)!r})
from model_server import fixture_model
from elmo_jax import pretrained
pretrained.MODELS["original"] = fixture_model("original")  # the registry entry, sized as the fixture files
"""


def test_notebook_is_stored_without_outputs():
    code = stored_code_cells(NOTEBOOK)
    source = "\n".join(c.source for c in code)
    # What a Colab user runs: the released model, no test machinery.
    assert 'MODEL = "original"' in source and "Embedder.from_pretrained(MODEL)" in source
    assert "fixture" not in source and "model_server" not in source


@pytest.mark.slow
def test_notebook_runs_against_a_local_mirror(tmp_path, monkeypatch):
    pytest.importorskip("ipykernel")
    import nbformat
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    jupyter_dir = _this_interpreter_kernelspec(tmp_path / "jupyter")
    monkeypatch.setenv(
        "JUPYTER_PATH", os.pathsep.join(filter(None, [str(jupyter_dir), os.environ.get("JUPYTER_PATH")]))
    )
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
    cache = tmp_path / "models"
    monkeypatch.setenv("ELMO_JAX_HOME", str(cache))
    monkeypatch.delenv("ELMO_JAX_OFFLINE", raising=False)
    monkeypatch.delenv("ELMO_JAX_SHA256", raising=False)
    work = tmp_path / "work"
    work.mkdir()

    nb = read_notebook(NOTEBOOK)
    n_stored = len(nb.cells)
    nb.cells.insert(0, nbformat.v4.new_code_cell(SETUP_CELL))
    with serve_fixture(tmp_path, "original") as server:
        monkeypatch.setenv("ELMO_JAX_MIRROR", server.url)
        client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}})
        try:
            client.execute()
        except CellExecutionError as e:  # the failing cell's traceback, not only nbclient's summary
            pytest.fail(f"a notebook cell raised:\n{e}")
    assert len(nb.cells) == n_stored + 1

    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
            assert not errors, f"cell {i}: {errors[0].ename}: {errors[0].evalue}"
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")

    # The download: options and weights, one GET each, from the mirror, into ELMO_JAX_HOME/original.
    gets = server.gets()
    assert len(server.gets("_options.json")) == 1 and len(server.gets("_weights.hdf5")) == 1, gets
    assert len(gets) == 2, gets
    manifest = json.loads((cache / "original" / "manifest.json").read_text(encoding="utf-8"))["files"]
    released = sorted(pretrained.MODELS["original"].files[role][0].local for role in ("options", "weights"))
    assert sorted(manifest) == released and all((cache / "original" / name).is_file() for name in released)
    assert all(entry["source"].startswith(server.url) for entry in manifest.values()), manifest
    assert re.search(r"original: 2 biLSTM layers of \d+ cells, ELMo vectors of \d+ numbers in 3 layers", text), text

    # The polysemy tables: every word, its 4x4 top-layer matrix, a line per layer and for the average.
    for word in ("bank", "play", "Apple"):
        assert f"'{word}': A = " in text, word
    assert len(re.findall(r"^\s+top-layer cosine\s+A0\s+A1\s+B0\s+B1$", text, re.M)) == 3
    summary = re.findall(
        r"^\s+(layer \d[^\n]*?|layers averaged)\s+within-sense (-?[0-9.]+)\s+across-sense "
        r"(-?[0-9.]+)\s+gap [+-][0-9.]+",
        text,
        re.M,
    )
    assert len(summary) == 3 * 4, summary
    # Layer 0 is context-free and the word is spelled alike in all four sentences: every similarity is 1.
    for name, within, across in summary:
        if name.startswith("layer 0"):
            assert (within, across) == ("1.000", "1.000"), (name, within, across)

    # The classifier: trained, both accuracies reported, each held-out sentence listed.
    assert re.search(r"sentence vectors \(24, \d+\)", text), text
    assert re.search(r"step\s+100\s+loss [0-9.]+", text), text
    assert re.search(r"train accuracy:\s+[01]\.\d\d \(16 sentences\)", text), text
    assert re.search(r"held-out accuracy:\s+[01]\.\d\d \(8 sentences\)", text), text
    assert len(re.findall(r"^\s+(ok   |WRONG) (food|technology)\s+<- ", text, re.M)) == 8
