"""Test set-up: two CPU devices for the multi-device tests, set before jax is imported.

No more than 2: with 4 or 8 fake devices XLA's CPU collectives time out on a 2-core machine.
"""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The CLI's persistent compilation cache stays off in tests (and out of ~/.cache) unless a test sets it.
os.environ["ELMO_JAX_COMPILE_CACHE"] = "none"

import pathlib  # noqa: E402

import pytest  # noqa: E402

FIXTURES = pathlib.Path(__file__).parent / "fixtures"


@pytest.fixture(scope="session")
def fixtures_dir() -> pathlib.Path:
    return FIXTURES
