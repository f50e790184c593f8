"""The Python version the project claims is one the pinned requirements install on.

README, ``requires-python`` and the pins once disagreed: the README said 3.10+ while the pinned
jax, numpy, flax and orbax need 3.11, so the README's first command failed inside pip. The pins'
own ``Requires-Python`` is read from their installed metadata (CI installs exactly
requirements.txt, so every pin is installed).
"""

import importlib.metadata
import pathlib
import re
import sys
import tomllib

from packaging.specifiers import SpecifierSet
from packaging.version import Version

ROOT = pathlib.Path(__file__).parent.parent


def _pins() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            name, sep, version = line.partition("==")
            assert sep, f"requirements.txt: {line!r} is not pinned with =="
            pins[name.strip()] = version.strip()
    return pins


def _project_pythons() -> list[Version]:
    """The 3.x releases ``requires-python`` allows, up to the one running the tests (newer ones
    may not have wheels yet, which is not the project's claim to check)."""
    spec = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["requires-python"])
    allowed = [Version(f"3.{minor}") for minor in range(sys.version_info.minor + 1) if Version(f"3.{minor}") in spec]
    assert allowed, f"requires-python {spec} allows no Python up to the running {sys.version.split()[0]}"
    return allowed


def test_every_pin_installs_on_every_python_the_project_allows():
    pythons = _project_pythons()
    problems = []
    for name, pinned in _pins().items():
        # The metadata read must be the pinned release's, not another one's.
        assert importlib.metadata.version(name) == pinned, (
            f"{name}: installed {importlib.metadata.version(name)}, pinned {pinned}"
        )
        needs = importlib.metadata.metadata(name).get("Requires-Python")
        refused = [str(v) for v in pythons if needs and v not in SpecifierSet(needs)]
        if refused:
            problems.append(f"{name}=={pinned} requires Python {needs}, refusing {', '.join(refused)}")
    assert not problems, "pyproject.toml allows Pythons the pins do not: " + "; ".join(problems)


def test_readme_states_the_same_minimum_python():
    minimum = _project_pythons()[0]
    readme = (ROOT / "README.md").read_text()
    claims = set(re.findall(r"Python (3\.\d+)(?:\+| or newer)", readme))
    assert claims == {str(minimum)}, f"README claims Python {sorted(claims)}; requires-python's minimum is {minimum}"
