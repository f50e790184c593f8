"""elmo_jax._util.runtime: the compile cache for library users, the GPU kernel flags, and the unused-accelerator
warning."""

import os
import subprocess
import sys

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


def test_a_compile_cache_where_a_file_is_is_one_warning_and_no_cache(tmp_path, restore_jax_cache_config):
    """jax would take it and fail every cache write without a word: every compile, every run."""
    (tmp_path / "a.txt").write_text("not a directory")
    before = jax.config.jax_compilation_cache_dir
    for path in (tmp_path / "a.txt", tmp_path / "a.txt" / "xla"):
        with pytest.warns(
            UserWarning, match=r"the compile cache .*a.txt.* is a file, not a directory; compiling without"
        ):
            assert runtime.enable_compile_cache(path) is None
        assert jax.config.jax_compilation_cache_dir == before
    # Negative control: a directory that is not there yet is made by jax, and taken.
    assert runtime.enable_compile_cache(tmp_path / "new") == str(tmp_path / "new")


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


def test_saved_gpu_kernels_keep_xlas_autotuning_in_the_run_directory(tmp_path):
    flags, note = runtime.gpu_kernel_flags("--xla_force_host_platform_device_count=2", "saved", tmp_path / "run")
    cache = f"--xla_gpu_per_fusion_autotune_cache_dir={tmp_path / 'run' / 'xla_autotune'}"
    assert flags.split() == ["--xla_force_host_platform_device_count=2", cache]
    assert str(tmp_path / "run" / "xla_autotune") in note
    assert runtime.gpu_kernel_flags(flags, "saved", tmp_path / "run")[0] == flags  # added once
    # Another run's directory (an earlier call in this process) gives way to this run's.
    other = runtime.gpu_kernel_flags(flags, "saved", tmp_path / "other")[0].split()
    assert other == ["--xla_force_host_platform_device_count=2", cache.replace("/run/", "/other/")]


def test_gpu_kernels_fall_back_to_xlas_deterministic_flag_where_they_cannot_be_saved(tmp_path):
    fixed = "--xla_gpu_exclude_nondeterministic_ops=true"
    for run_dir, several, why in (
        ("gs://bucket/run", False, "gs://bucket/run is not a local path"),
        (tmp_path / "my run", False, "has a space"),
        (tmp_path / "run", True, "each of the run's processes would time its own candidates"),
        (None, False, "no run directory"),
    ):
        flags, note = runtime.gpu_kernel_flags("", "saved", run_dir, several)
        assert flags == fixed and "not saved: " in note and why in note, (run_dir, note)
    assert runtime.gpu_kernel_flags("", "fixed", tmp_path)[0] == fixed
    # A flag the user set is kept as set, not doubled or overridden.
    mine = "--xla_gpu_exclude_nondeterministic_ops=false"
    assert runtime.gpu_kernel_flags(mine, "fixed", tmp_path)[0] == mine
    assert runtime.gpu_kernel_flags(" --a=1 ", "tuned", tmp_path)[0] == " --a=1 "
    with pytest.raises(ValueError, match="expected one of saved, fixed, tuned"):
        runtime.gpu_kernel_flags("", "fast", tmp_path)


@pytest.mark.slow
def test_xla_accepts_the_flags_of_every_gpu_kernels_mode(tmp_path):
    """XLA aborts at start-up on a flag it does not know, GPU flags included, and a CPU build knows
    them all: so a misspelt flag fails here, not first on a GPU. The negative control is one."""
    program = "import jax.numpy as jnp; print(float((jnp.ones((4, 4)) @ jnp.ones((4, 4))).sum()))"

    def run(flags: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
        return subprocess.run([sys.executable, "-c", program], env=env, capture_output=True, text=True, timeout=120)

    every = " ".join(runtime.gpu_kernel_flags("", mode, tmp_path / "run")[0] for mode in runtime.GPU_KERNELS)
    assert {f.split("=")[0] for f in every.split()} == {
        "--xla_gpu_per_fusion_autotune_cache_dir",
        "--xla_gpu_exclude_nondeterministic_ops",
    }
    r = run(every)
    assert r.returncode == 0 and r.stdout.strip() == "64.0", r.stderr[-500:]
    assert run("--xla_gpu_per_fusion_autotune_cache_dirr=/x").returncode != 0


def test_set_gpu_kernels_sets_the_flags_and_keeps_jax_from_moving_the_autotuning_cache(tmp_path, monkeypatch):
    """With its compilation cache on, jax points XLA's autotuning cache at a directory of its own
    whenever this option names it; saved kernels need the run's directory to stand."""
    before = jax.config.jax_persistent_cache_enable_xla_caches
    assert "xla_gpu_per_fusion_autotune_cache_dir" in before  # jax's default: the override is on
    monkeypatch.setenv("XLA_FLAGS", "--a=1")
    try:
        note = runtime.set_gpu_kernels("saved", tmp_path)
        assert os.environ["XLA_FLAGS"] == runtime.gpu_kernel_flags("--a=1", "saved", tmp_path)[0] != "--a=1"
        assert note == runtime.gpu_kernel_flags("--a=1", "saved", tmp_path)[1]
        assert "xla_gpu_per_fusion_autotune_cache_dir" not in jax.config.jax_persistent_cache_enable_xla_caches
    finally:
        jax.config.update("jax_persistent_cache_enable_xla_caches", before)


def test_saved_kernels_make_their_directory_where_an_nvidia_driver_is(tmp_path, monkeypatch):
    """XLA needs the autotuning directory to exist; it is made only where a GPU may use it, and a
    directory that cannot be made means the XLA flag instead (a file stands in its way here)."""
    before = jax.config.jax_persistent_cache_enable_xla_caches
    try:
        monkeypatch.setenv("XLA_FLAGS", "")
        monkeypatch.setattr(runtime, "_accelerator", lambda: None)
        runtime.set_gpu_kernels("saved", tmp_path / "cpu_run")
        assert not (tmp_path / "cpu_run").exists()  # no clutter in a CPU run's directory
        monkeypatch.setattr(runtime, "_accelerator", lambda: "cuda12")
        runtime.set_gpu_kernels("saved", tmp_path / "gpu_run")
        assert (tmp_path / "gpu_run" / "xla_autotune").is_dir()
        (tmp_path / "blocked").write_text("a file, not a directory")
        monkeypatch.setenv("XLA_FLAGS", "")
        note = runtime.set_gpu_kernels("saved", tmp_path / "blocked")
        assert os.environ["XLA_FLAGS"] == "--xla_gpu_exclude_nondeterministic_ops=true"
        assert f"(not saved: {tmp_path / 'blocked' / 'xla_autotune'}: " in note, note
    finally:
        jax.config.update("jax_persistent_cache_enable_xla_caches", before)
