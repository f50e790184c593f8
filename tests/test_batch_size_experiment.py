"""experiments/batch_size.py: arms are read and checked, and the table lines arms up at equal tokens."""

import json

import batch_size
import pytest


def test_arms_are_rows_steps_and_devices():
    assert batch_size.parse_arm("192x400") == (192, 400, 1)
    assert batch_size.parse_arm("192x400@2") == (192, 400, 2)
    with pytest.raises(SystemExit, match="ROWSxSTEPS"):
        batch_size.parse_arm("192-400")
    with pytest.raises(SystemExit, match="do not split over 5 devices"):
        batch_size.parse_arm("192x400@5")


def test_the_table_compares_arms_at_the_same_number_of_tokens(tmp_path):
    def write(name, records):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    def record(step, ppl):
        return {
            "step": step,
            "loss": 5.0,
            "heldout_perplexity": ppl,
            "heldout_perplexity_fwd": ppl + 1,
            "heldout_perplexity_bwd": ppl - 1,
        }

    write("64x6", [record(3, 300.0), {"step": 4, "loss": 4.0}, record(6, 200.0)])
    write("192x2", [record(1, 310.0), record(2, 190.0)])
    runs = {n: str(tmp_path / n) for n in ("64x6", "192x2")}
    lines = batch_size.table(runs, {"64x6": 64 * 20, "192x2": 192 * 20})
    body = lines[2:]
    assert len(body) == 2  # two token counts; the record without a held-out score is not a row
    assert body[0].startswith("| 3,840 |") and "**300.0**" in body[0] and "**310.0**" in body[0]
    assert body[1].startswith("| 7,680 |") and "201.0 / 199.0 / **200.0**" in body[1] and "**190.0**" in body[1]
