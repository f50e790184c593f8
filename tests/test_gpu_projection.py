"""benchmarks/gpu_projection.py reads its GPU inputs from the committed bench_variants.py outputs:
a change to that output's format must not leave the cost model reading nothing."""

import pathlib

import gpu_projection


def test_the_h100_steps_are_read_from_the_results_files():
    read = {}
    for name, variants in (
        ("call1_variants.txt", {"f32", "bf16", "tf32", "bf16-c0-u20"}),
        ("call2_variants.txt", {"f32", "gpu"}),
    ):
        path = pathlib.Path(gpu_projection.H100) / name
        device, steps = read[name] = gpu_projection.measured_steps(str(path))
        assert "H100" in device
        assert variants <= set(steps)
        text = path.read_text(encoding="utf-8")
        for ms, gflop in steps.values():
            assert f"{ms:.2f} ms/step" in text and f"{gflop:,.0f} GFLOP a step" in text
    # The bfloat16 default is faster than float32 at the same work: what the model's rates rest on.
    steps = read["call2_variants.txt"][1]
    assert steps["gpu"][0] < steps["f32"][0] and steps["gpu"][1] == steps["f32"][1]
