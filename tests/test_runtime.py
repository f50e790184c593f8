"""elmo_jax._util.runtime: the compile cache for library users, and the unused-accelerator warning."""

import jax
import pytest

from elmo_jax._util import runtime
from elmo_jax.cli import commands


@pytest.fixture
def restore_jax_cache_config():
    names = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    before = {n: getattr(jax.config, n) for n in names}
    yield
    for n, v in before.items():
        jax.config.update(n, v)


def test_enable_compile_cache_defaults_to_the_clis_directory(tmp_path, monkeypatch, restore_jax_cache_config):
    monkeypatch.setenv("ELMO_JAX_COMPILE_CACHE", str(tmp_path / "xla"))
    assert runtime.enable_compile_cache() == str(tmp_path / "xla") == runtime.default_compile_cache()
    assert jax.config.jax_compilation_cache_dir == str(tmp_path / "xla")
    assert runtime.enable_compile_cache(tmp_path / "other") == str(tmp_path / "other")
    monkeypatch.delenv("ELMO_JAX_COMPILE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert runtime.default_compile_cache() == str(tmp_path / "cache" / "elmo_jax" / "xla")
    assert runtime.enable_compile_cache("none") is None and runtime.enable_compile_cache("") is None
    assert commands.enable_compile_cache is runtime.enable_compile_cache  # the CLI uses the same one


@pytest.fixture
def machine(monkeypatch):
    """A machine with no accelerator, no plugin, no JAX_PLATFORMS, and a fresh 'warned once' flag."""
    monkeypatch.setattr(runtime, "_warned", False)
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    for var in ("TPU_NAME", "COLAB_TPU_ADDR"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(runtime.shutil, "which", lambda name: None)
    monkeypatch.setattr(runtime.glob, "glob", lambda pattern: [])
    monkeypatch.setattr(runtime, "_tpu_on_pci", lambda: False)
    monkeypatch.setattr(runtime, "_installed", lambda *names: False)
    return monkeypatch


def test_a_gpu_with_the_cpu_jaxlib_warns_once_with_the_install_command(machine, capsys):
    machine.setattr(runtime.shutil, "which", lambda name: "/usr/bin/nvidia-smi" if name == "nvidia-smi" else None)
    assert runtime.warn_if_accelerator_unused()
    assert not runtime.warn_if_accelerator_unused()  # once per process
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "NVIDIA GPU" in err
    assert f'pip install -U "jax[cuda12]=={jax.__version__}"' in err


def test_a_tpu_warns_with_the_tpu_extra(machine, capsys):
    machine.setenv("TPU_NAME", "my-tpu")
    assert runtime.warn_if_accelerator_unused()
    assert f'"jax[tpu]=={jax.__version__}"' in capsys.readouterr().err
    machine.setattr(runtime, "_warned", False)
    machine.delenv("TPU_NAME")
    machine.setattr(runtime.glob, "glob", lambda pattern: ["/dev/accel0"] if pattern == "/dev/accel*" else [])
    assert runtime.warn_if_accelerator_unused()


def test_no_warning_without_an_accelerator_with_its_plugin_or_with_jax_platforms_cpu(machine, capsys):
    assert not runtime.warn_if_accelerator_unused()  # nothing there
    machine.setattr(runtime.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    machine.setattr(runtime, "_installed", lambda *names: "jax-cuda12-plugin" in names)
    assert not runtime.warn_if_accelerator_unused()  # the GPU jaxlib is installed
    machine.setattr(runtime, "_installed", lambda *names: False)
    machine.setenv("JAX_PLATFORMS", "cpu")
    assert not runtime.warn_if_accelerator_unused()  # the CPU on purpose
    assert capsys.readouterr().err == ""


def test_the_check_never_raises(machine, capsys):
    def broken():
        raise OSError("no /dev")

    machine.setattr(runtime, "_accelerator", broken)
    assert not runtime.warn_if_accelerator_unused()
    assert capsys.readouterr().err == ""


def test_the_readme_install_commands_use_the_pinned_jax():
    import pathlib
    import re

    root = pathlib.Path(__file__).parent.parent
    pin = re.search(r"^jax==(\S+)$", (root / "requirements.txt").read_text(), re.M).group(1)
    versions = re.findall(r'"jax\[(?:cuda12|tpu)\]==([^"]+)"', (root / "README.md").read_text())
    assert len(versions) == 2 and set(versions) == {pin}
