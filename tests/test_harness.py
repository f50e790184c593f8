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
    # 32 more dependent matmuls take measurably longer: none was hoisted out of the loop or skipped.
    assert rate.seconds[1] > 2 * rate.seconds[0] > 0
    assert rate.tflops > 0
    assert rate.line().startswith("float32 128^3 matmul, slope of 8 and 40 dependent matmuls")


@pytest.mark.slow
def test_a_loop_invariant_matmul_is_hoisted_and_measures_nothing():
    """Negative control: a body ``x + a @ b`` lets XLA compute ``a @ b`` once, before the loop, so
    40 iterations take about as long as 8 (the chain's matmuls are what the slope method times).

    Timed in a subprocess compiled as users compile, not at the suite's lower optimisation level
    (``helpers.xla_flags``), where the loop's elementwise add costs more beside the matmul."""
    script = """
import json, harness
hoisted = harness.matmul_slope(128, "float32", counts=(8, 40), repeats=3, dependent=False)
chained = harness.matmul_slope(128, "float32", counts=(8, 40), repeats=3)
print(json.dumps([hoisted.seconds, chained.seconds]))
"""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, cwd=BENCHMARKS, capture_output=True, text=True, check=True
    )
    hoisted, chained = json.loads(out.stdout.splitlines()[-1])
    extra = lambda seconds: seconds[1] - seconds[0]  # noqa: E731 - the time of 32 more iterations
    assert extra(hoisted) < extra(chained) / 5, (hoisted, chained)
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
