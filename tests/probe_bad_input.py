"""A probe of every path flag of every command given a path of the wrong kind, and of numeric
flags given values out of range: run by hand, not by the suite (the file name does not match
``test_*.py``).

    python tests/probe_bad_input.py              # every case
    python tests/probe_bad_input.py --only train # one command's

Each case runs the command in this process (``elmo_jax.cli.commands.main``) with valid arguments
but for one flag, whose path is of one wrong kind: missing, a directory where a file is read, a
file where a directory is, a path under a file, an empty file or directory, random bytes, or
another format's file; or whose value is out of range (0 rows, a negative seed, an infinite
learning rate). It prints a line per case, sorted as:

- ``one line``: exit 2 (or 1) with exactly one ``elmo-jax CMD: error:`` line;
- ``NO FLAG``: one line, but it names neither the flag nor the path given;
- ``TRACEBACK``: an exception the command line has no line for;
- ``ACCEPTED``: exit 0: the command took the bad path (right for some, e.g. an output directory
  that does not exist yet; the case says so).

``tests/test_bad_input.py`` keeps every case this probe runs, as a test.
"""

import argparse
import pathlib
import sys
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).parent))

import bad_input


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="one command's cases")
    args = ap.parse_args()
    counts: dict[str, int] = {}
    with tempfile.TemporaryDirectory() as tmp:
        world = bad_input.World(pathlib.Path(tmp))
        for case in bad_input.CASES:
            if args.only and case.command != args.only:
                continue
            outcome = bad_input.run(case, world)
            counts[outcome.kind] = counts.get(outcome.kind, 0) + 1
            print(f"{outcome.kind:10s} {case.id:40s} {outcome.detail}", flush=True)
    print(" ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
