"""Process-wide JAX settings for the CLI and for library users (a notebook, a script).

``enable_compile_cache()`` turns on the persistent XLA compilation cache the CLI uses;
``warn_if_accelerator_unused()`` says, in one line, when a GPU or TPU is present but JAX would run
on the CPU (requirements.txt pins the CPU jaxlib). Importing this module does not import JAX.
"""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shutil
import sys

__all__ = ["default_compile_cache", "enable_compile_cache", "warn_if_accelerator_unused"]

_warned = False


def default_compile_cache() -> str:
    """``$ELMO_JAX_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/elmo_jax/xla`` (``~/.cache/...``)."""
    if "ELMO_JAX_COMPILE_CACHE" in os.environ:
        return os.environ["ELMO_JAX_COMPILE_CACHE"]
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "elmo_jax", "xla")


def enable_compile_cache(path: str | None = None) -> str | None:
    """JAX's persistent compilation cache in ``path`` (default ``default_compile_cache()``; "" or
    "none": off). Returns the directory used, or None when off.

    A job compiles one program per batch shape (about a second each on a CPU); a second run
    with the same shapes loads them instead. Every compile is kept, since even short ones add
    up over a job's many shapes.
    """
    path = default_compile_cache() if path is None else os.fspath(path)
    if path.lower() in ("", "none"):
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


def _tpu_on_pci() -> bool:
    """JAX's own TPU check (Google TPU device ids on the PCI bus); False when it is not there."""
    try:
        from jax._src import hardware_utils  # private: guarded, and only asked when /dev/vfio exists

        return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
    except Exception:  # noqa: BLE001 - a private API: any failure means no TPU
        return False


def _accelerator() -> str | None:
    """``"cuda12"`` or ``"tpu"`` when this machine seems to have an NVIDIA GPU or a TPU, else None.

    Only cheap checks: ``nvidia-smi`` on PATH (not run), the TPU device files ``/dev/accel*``
    (TPU v2-v4), the environment variables TPU VMs and Colab set, and for ``/dev/vfio`` (newer
    TPU VMs, but also any VFIO host) a TPU on the PCI bus.
    """
    if shutil.which("nvidia-smi"):
        return "cuda12"
    if glob.glob("/dev/accel*") or os.environ.get("TPU_NAME") or os.environ.get("COLAB_TPU_ADDR"):
        return "tpu"
    if os.path.exists("/dev/vfio") and _tpu_on_pci():
        return "tpu"
    return None


# The distributions that let jaxlib use each accelerator ("jax[cuda12]" installs the first, and so on).
_PLUGINS = {"cuda12": ("jax-cuda12-plugin", "jax-cuda13-plugin"), "tpu": ("libtpu", "libtpu-nightly")}


def _installed(*names: str) -> bool:
    for name in names:
        try:
            importlib.metadata.version(name)
            return True
        except importlib.metadata.PackageNotFoundError:
            pass
    return False


def warn_if_accelerator_unused() -> bool:
    """One line on stderr, once per process, when a GPU or TPU is present but JAX will run on the CPU.

    "Will run on the CPU": no jaxlib plugin for that accelerator is installed (requirements.txt pins
    the CPU jaxlib) and ``JAX_PLATFORMS`` does not ask for the CPU on purpose. The check does not
    start a JAX backend (``jax.default_backend()`` would, and the CLI must set ``XLA_FLAGS`` and
    start ``jax.distributed`` first); a plugin that is installed but fails is JAX's own warning.
    The line names the install command for the installed jax version. Never raises (a failed
    check means no warning); returns whether it warned.
    """
    global _warned
    if _warned:
        return False
    try:
        if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
            return False
        extra = _accelerator()
        if extra is None or _installed(*_PLUGINS[extra]):
            return False
        version = importlib.metadata.version("jax")
    except Exception:  # noqa: BLE001 - a warning must never stop a command
        return False
    _warned = True
    device = "an NVIDIA GPU" if extra == "cuda12" else "a TPU"
    print(
        f"elmo-jax: warning: this machine has {device} but JAX will run on the CPU (CPU-only jaxlib); "
        f'to use it: pip install -U "jax[{extra}]=={version}"',
        file=sys.stderr,
    )
    return True
