"""How long a fresh process takes to import jax and what each elmo-jax command imports.

    python benchmarks/import_time.py [--repeats 5]

Every ``elmo-jax`` command, every worker of a multi-process run and every test subprocess pays
this before its first line of work. Each figure is the median wall time of ``--repeats`` fresh
interpreters (``python -c "import ..."``), beside the same for ``ml_dtypes`` alone: jax imports
it, and its version decides most of the difference (0.7.0 registers its casts with numpy's ufuncs
in about 0.85 s; requirements.txt pins 0.6.0).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

IMPORTS = {
    "nothing (the interpreter)": "pass",
    "numpy": "import numpy",
    "ml_dtypes": "import numpy, ml_dtypes",
    "jax": "import jax",
    "the CLI (elmo_jax.cli.commands)": "import elmo_jax.cli.commands",
    "training (the CLI, the loop, Orbax)": "import elmo_jax.cli.commands, elmo_jax.training.loop, orbax.checkpoint",
}


def seconds(statement: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", statement], check=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import jax
    import ml_dtypes

    print(f"python {sys.version.split()[0]}, jax {jax.__version__}, ml_dtypes {ml_dtypes.__version__}")
    print(f"median of {args.repeats} fresh processes, wall time:")
    for name, statement in IMPORTS.items():
        seconds(statement)  # the first run may compile .pyc files
        times = [seconds(statement) for _ in range(args.repeats)]
        print(f"  {name:40s} {statistics.median(times):6.2f} s  (min {min(times):.2f}, max {max(times):.2f})")


if __name__ == "__main__":
    main()
