"""Test set-up: two CPU devices for the multi-device tests, set before jax is imported.

No more than 2: with 4 or 8 fake devices XLA's CPU collectives time out on a 2-core machine.
"""

import atexit
import os
import shutil
import tempfile

from helpers import xla_flags  # imports no jax, which must not start before XLA_FLAGS is set

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + xla_flags(2)).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# A suite run inside a cluster's job (an srun step, mpirun) would make every `elmo-jax train` it
# starts one process of the job's run (multihost.from_cluster). The tests say which they want.
for _name in [n for n in os.environ if n.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR_"))]:
    del os.environ[_name]
# One persistent compilation cache for the session (never ~/.cache): many tests build the same
# programs (the tiny model's train step, the CLI's in subprocesses) from new closures, which
# jax's in-memory cache does not match but the persistent one, keyed by the program, does.
_CACHE = tempfile.mkdtemp(prefix="elmo_jax_test_xla_")
atexit.register(shutil.rmtree, _CACHE, True)
os.environ["ELMO_JAX_COMPILE_CACHE"] = _CACHE
# The same cache for subprocesses that use the library without the CLI (the notebook's kernel):
# jax reads these at import.
os.environ["JAX_COMPILATION_CACHE_DIR"] = _CACHE
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "0"

import pathlib  # noqa: E402

import pytest  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    return FIXTURES


def pytest_configure(config):
    from elmo_jax._util.runtime import enable_compile_cache

    enable_compile_cache(_CACHE)  # in-process library calls too, not only the CLI
