"""experiments/colab_quickstart.ipynb runs top to bottom (a short training run) and is stored without outputs.

The notebook is executed in a fresh kernel with ``nbclient``, in a temporary working directory, with
``ELMO_NOTEBOOK_STEPS=20``, ``ELMO_NOTEBOOK_HELDOUT_SENTENCES=40`` and the run directory under
``tmp_path``. The kernel inherits this process's environment (``XLA_FLAGS`` and the session's
compile cache from conftest). To be sure the kernel is this interpreter (the one
with elmo_jax installed) and not whatever a user-level "python3" kernelspec points at, the test puts a
"python3" kernelspec whose argv is ``sys.executable`` first on ``JUPYTER_PATH``.
"""

import json
import os
import pathlib
import re
import sys

import pytest

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "colab_quickstart.ipynb"


def read_notebook(path: pathlib.Path = NOTEBOOK):
    import nbformat

    return nbformat.read(path, as_version=4)


def stored_code_cells(path: pathlib.Path) -> list:
    """The notebook's code cells, after checking it is valid, runs in "python3" and stores no outputs."""
    import nbformat

    nb = read_notebook(path)
    nbformat.validate(nb)
    assert nb.metadata["kernelspec"]["name"] == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code, "no code cells"
    for i, cell in enumerate(code):
        assert cell.get("outputs", []) == [], f"code cell {i} has stored outputs: clear them before committing"
        assert cell.get("execution_count") is None, f"code cell {i} has an execution count"
    return code


def test_notebook_is_stored_without_outputs():
    stored_code_cells(NOTEBOOK)


def _this_interpreter_kernelspec(root: pathlib.Path) -> pathlib.Path:
    """A JUPYTER_PATH dir with a "python3" kernelspec that runs ``sys.executable``."""
    spec_dir = root / "kernels" / "python3"
    spec_dir.mkdir(parents=True)
    spec = {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3 (test)",
        "language": "python",
    }
    (spec_dir / "kernel.json").write_text(json.dumps(spec), encoding="utf-8")
    return root


def _text(cell) -> str:
    parts = []
    for out in cell.get("outputs", []):
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.get("data", {}).get("text/plain", ""))
    return "".join(parts)


@pytest.mark.slow
def test_notebook_runs(tmp_path, monkeypatch):
    pytest.importorskip("ipykernel")
    from jupyter_client.kernelspec import KernelSpecManager
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    jupyter_dir = _this_interpreter_kernelspec(tmp_path / "jupyter")
    monkeypatch.setenv(
        "JUPYTER_PATH", os.pathsep.join(filter(None, [str(jupyter_dir), os.environ.get("JUPYTER_PATH")]))
    )
    assert KernelSpecManager().get_kernel_spec("python3").argv[0] == sys.executable
    run_dir = tmp_path / "run"
    monkeypatch.setenv("ELMO_NOTEBOOK_STEPS", "20")
    monkeypatch.setenv("ELMO_NOTEBOOK_HELDOUT_SENTENCES", "40")
    monkeypatch.setenv("ELMO_NOTEBOOK_RUN_DIR", str(run_dir))
    work = tmp_path / "work"
    work.mkdir()

    nb = read_notebook()
    client = NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}})
    try:
        client.execute()
    except CellExecutionError as e:  # the failing cell's traceback, not only nbclient's summary
        pytest.fail(f"a notebook cell raised:\n{e}")

    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code":
            errors = [o for o in cell.get("outputs", []) if o.output_type == "error"]
            assert not errors, f"cell {i}: {errors[0].ename}: {errors[0].evalue}"
    text = "\n".join(_text(c) for c in nb.cells if c.cell_type == "code")

    # Training: 20 steps into the run dir, logged and checkpointed.
    assert re.search(r"step\s+20\s+loss", text), text[-3000:]
    with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
        assert json.loads(f.readlines()[-1])["step"] == 20
    assert (run_dir / "options.json").is_file() and (run_dir / "vocab.txt").is_file()
    # Both held-out protocols.
    for name in ("carried state", "reset per sentence", "unigram baseline"):
        assert re.search(rf"{name}\s*: perplexity\s+[0-9.]+", text), name
    # The cosine table for every probe word; layer 0 is context-free: all pairs exactly alike.
    for word in ("Apple", "bank", "plant"):
        assert f"'{word}': sentences 0-1" in text
    layer0 = [line for line in text.splitlines() if line.strip().startswith("layer 0 cosine")]
    assert len(layer0) == 3
    for line in layer0:
        values = re.findall(r"\d-\d: ([0-9.]+)", line)
        assert len(values) == 6 and set(values) == {"1.000"}, line
    assert len([line for line in text.splitlines() if "within-sense" in line]) == 9
    # The downstream tagger: frozen biLM outside the params, loss going down.
    assert "biLM weights among the trainable params: False" in text
    m = re.search(r"mean loss of 5 steps: first ([0-9.]+) -> last ([0-9.]+)", text)
    assert m and float(m.group(2)) < 0.75 * float(m.group(1)), m and m.group(0)
    assert "held-out token accuracy" in text
    # Plots were produced (two figures and the loss curve).
    images = [
        o
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
        if o.output_type == "display_data" and "image/png" in o.get("data", {})
    ]
    assert len(images) >= 2
