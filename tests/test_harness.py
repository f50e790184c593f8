"""benchmarks/harness.py: the roofline's slope method and its MFU denominators."""

import json
import os
import pathlib
import subprocess
import sys

import harness
import pytest

BENCHMARKS = pathlib.Path(__file__).parents[1] / "benchmarks"


def test_the_slope_method_times_every_matmul_of_the_chain():
    rate = harness.matmul_slope(128, "float32", counts=(8, 40), repeats=3)
    # That no matmul leaves the loop is read from the program (below); here only that 32 more
    # of them take longer at all, so that the slope is a rate.
    assert rate.seconds[1] > rate.seconds[0] > 0
    assert rate.tflops > 0
    assert rate.line().startswith("float32 128^3 matmul, slope of 8 and 40 dependent matmuls")


@pytest.mark.slow
def test_the_chain_keeps_its_matmuls_in_the_loop_and_a_loop_invariant_one_does_not():
    """Negative control of the slope method: a body ``x + a @ b`` lets XLA compute ``a @ b`` once,
    outside the loop (two constants: it folds them), so its 40 iterations would time no matmul.
    The dependent chain, which ``matmul_slope`` times, keeps its matmul in the loop body.

    Read from the compiled programs, not timed (a timing bound failed in a loaded suite). Compiled
    in a subprocess as users compile, not at the suite's lower optimisation level
    (``helpers.xla_flags``)."""
    script = """
import json, harness
from elmo_jax._util.hlo import loop_body_ops
out = {}
for dependent in (True, False):
    chain, x = harness.matmul_chain(128, "float32", dependent)
    out[str(dependent)] = sorted(loop_body_ops(chain(40).lower(x).compile().as_text()))
print(json.dumps(out))
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=BENCHMARKS, capture_output=True, text=True, check=True
    )
    ops = json.loads(out.stdout.splitlines()[-1])
    assert "dot" in ops["True"], ops
    assert "dot" not in ops["False"] and "add" in ops["False"], ops
    assert not harness.matmul_slope(64, "float32", counts=(8, 8), repeats=1).tflops > 0


def test_mfu_names_both_denominators():
    measured = {"bfloat16": harness.MatmulRate("bfloat16", 8192, (8, 40), (0.1, 0.3), 650.0)}
    line = harness.mfu(98.94, "bfloat16", "NVIDIA H100 80GB HBM3", measured)
    assert line == (
        "10.0% of the H100 SXM datasheet dense bfloat16 peak (989 TFLOP/s); "
        "15.2% of the measured bfloat16 8192^3 matmul (650 TFLOP/s)"
    )
    assert harness.dense_peak("NVIDIA H100 PCIe")[0] == "H100 PCIe"
    assert harness.dense_peak("NVIDIA H200")[0] == "H200 SXM"
    assert harness.dense_peak("NVIDIA A100-SXM4-80GB")[1]["tf32"] == 156.0
    assert harness.dense_peak("cpu") is None
    assert harness.mfu(1.0, "float32", "cpu", {}) == "datasheet float32 peak n/a; measured float32 matmul n/a"
