"""benchmarks/gpu_measure.py: the one GPU call's driver keeps to its budget and writes text files."""

import sys

import gpu_measure


def test_a_part_over_its_limit_is_cut_short_and_keeps_its_lines(tmp_path):
    cmd = [sys.executable, "-u", "-c", "import time; print('measured'); time.sleep(30)"]
    outcome = gpu_measure.run_part("slow", cmd, str(tmp_path), 2.0)
    assert outcome.startswith("cut short at its 2 s limit")
    text = (tmp_path / "slow.txt").read_text()
    assert text.startswith("measured\n") and "[slow: cut short" in text
    assert gpu_measure.run_part("quick", [sys.executable, "-c", "print(1)"], str(tmp_path), 20.0).startswith("exit 0")


def test_the_job_is_natural_text_of_at_least_the_tokens_asked(tmp_path):
    path, tokens = gpu_measure.job_file(str(tmp_path), 100_000)
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    assert tokens == sum(len(line.split()) for line in lines) >= 100_000


def test_every_part_of_a_measurement_or_rehearsal_has_a_budget():
    for rows in (gpu_measure.FULL["rows"], gpu_measure.REHEARSAL["rows"]):
        names = ["roofline", *(f"step{r}" for r in rows), *(f"saved{r}" for r in rows), f"saved_again{rows[0]}"]
        names += [f"axis2_{r}" for r in rows] + [f"wave{r}" for r in rows] + [f"cnnvjp{rows[0]}", f"towers{rows[1]}"]
        names += ["cli", "extract", "autodiff128"]
        for name in names + [f"baseline{r}" for r in rows] + ["profile"]:
            assert gpu_measure.budget_key(name) in gpu_measure.BUDGETS, name
    assert gpu_measure.budget_key("saved_again4") == "saved_again128" and gpu_measure.budget_key("step12") == "step384"
    assert gpu_measure.budget_key("saved384") == "saved384" and gpu_measure.budget_key("saved4") == "saved128"


def test_each_variant_is_set_against_the_step_of_its_rows(tmp_path):
    def part(name, rows, ms):
        (tmp_path / f"{name}.txt").write_text(f"step {rows} rows: {ms} ms/step (median of 10), 1 tokens/s\n")

    part("step128", 128, "13.00")
    part("wave128", 128, "11.70")
    part("cnnvjp128", 128, "13.65")
    part("wave384", 384, "20.00")  # its base did not run
    lines = gpu_measure.comparisons(str(tmp_path), (128, 384))
    assert lines == [
        "cnnvjp128 (Layout.cnn_vjp): 13.65 ms a step against step128's 13.00: 5.0 % slower",
        "wave128 (Layout.lstm_wavefront): 11.70 ms a step against step128's 13.00: 10.0 % faster",
        "wave384 (Layout.lstm_wavefront): 20.00 ms a step; step384 did not run",
    ]
