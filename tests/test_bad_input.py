"""A path of the wrong kind for any path flag of any command, or a value out of range for a
numeric one, is one line that names the flag (or the path) and says what is wrong, exit 2, with
nothing written: never a traceback, never a message about a temporary file, never a flag silently
ignored (``bad_input.py`` has the cases; ``probe_bad_input.py`` prints them)."""

import pytest
from bad_input import ACCEPTED, CASES, World, run


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_a_path_of_the_wrong_kind_or_a_value_out_of_range_is_one_line_naming_it(case, tmp_path):
    outcome = run(case, World(tmp_path))
    if case.id in ACCEPTED:
        assert outcome.kind == "ACCEPTED", outcome.detail
        return
    assert (outcome.kind, outcome.code) == ("one line", 2), outcome.detail
    assert "Errno" not in outcome.err and ".tmp" not in outcome.err, outcome.err
    assert outcome.left == [], outcome.left  # nothing written: no run dir, no partial output


def test_a_uri_is_left_to_its_file_system_and_a_local_path_is_checked(tmp_path):
    from elmo_jax._util.paths import fault

    assert fault("gs://bucket/run/o.hdf5", "output") is None and fault("gs://bucket/in.txt", "file") is None
    assert fault(tmp_path / "no" / "deeper" / "o.hdf5", "output") == (str(tmp_path / "no"), "does not exist")
    assert fault(tmp_path / "o.hdf5", "output") is None  # negative control: a new file in a directory that is there


def test_a_directory_another_process_makes_meanwhile_is_never_said_to_be_a_file(tmp_path, monkeypatch):
    """Each process of a multi-host run makes the run dir and checks it. Asked "a directory?" and
    then "there?", one that another process made between the two was "a file, not a directory"
    (seen: process 0 of 2 exiting 2 so in the suite). Here the first question is answered as if the
    directory were not there yet; one stat answers both."""
    import os.path

    from elmo_jax._util.paths import IS_A_FILE, check_dir_to_make, fault

    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setattr(os.path, "isdir", lambda p: False)  # "not yet", then made by the other process
    assert fault(run, "dir") is None
    check_dir_to_make(run)
    monkeypatch.undo()
    # Negative control: a file there is one.
    (tmp_path / "f").write_text("x")
    assert fault(tmp_path / "f", "dir") == (str(tmp_path / "f"), IS_A_FILE)


def test_a_directory_given_for_a_file_pattern_is_answered_with_the_pattern_to_give(tmp_path):
    outcome = run(next(c for c in CASES if c.id == "train --train-files a-dir"), World(tmp_path))
    assert "adir is a directory: give a pattern of its files, '" in outcome.err and "adir/*.txt'" in outcome.err
    # Negative control: a pattern that names nothing gets no such hint.
    outcome = run(next(c for c in CASES if c.id == "train --train-files missing"), World(tmp_path))
    assert "no files match" in outcome.err and "is a directory" not in outcome.err
