"""Process-wide JAX settings for the CLI and for library users (a notebook, a script).

``enable_compile_cache()`` turns on the persistent XLA compilation cache the CLI uses;
``gpu_kernel_flags()`` says how XLA picks a GPU's kernels, so that a training run repeats to the
bit; ``warn_if_accelerator_unused()`` says, in one line, when a GPU or TPU is present but JAX would run
on the CPU (requirements.txt pins the CPU jaxlib). Importing this module does not import JAX.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.metadata
import logging
import os
import shutil
import sys
import warnings
from collections.abc import Iterator

from elmo_jax._util.atomic import is_local
from elmo_jax._util.paths import MISSING, check_writable, describe, fault, said

__all__ = [
    "GPU_KERNELS",
    "absl_errors_only",
    "default_compile_cache",
    "enable_compile_cache",
    "gpu_kernel_flags",
    "set_gpu_kernels",
    "warn_if_accelerator_unused",
]

_warned = False


@contextlib.contextmanager
def absl_errors_only() -> Iterator[None]:
    """absl's log (Orbax's, tfds's) at ERROR and above while the block runs: for its warnings that
    the caller says better in its own line, or that say what the caller means to happen."""
    absl = logging.getLogger("absl")
    level = absl.level
    absl.setLevel(logging.ERROR)
    try:
        yield
    finally:
        absl.setLevel(level)


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
    bad = fault(path, "dir")
    try:
        if bad is None:
            check_writable(path)
        elif bad[1] == MISSING:
            # Made now rather than by jax at its first write, where a directory it cannot make
            # (not this user's, a read-only file system) is a warning per program, naming none of this.
            os.makedirs(path, exist_ok=True)
            bad = None
    except OSError as e:
        bad = describe(e)
    if bad is not None:  # jax would ignore a file there, and fail to write in the others
        warnings.warn(
            f"the compile cache {said(*bad, path)}; compiling without one: give it another directory "
            "($ELMO_JAX_COMPILE_CACHE, or elmo-jax --compile-cache)",
            stacklevel=2,
        )
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


# How XLA picks the kernels of a GPU program (``elmo-jax train --gpu-kernels``): "saved" autotunes
# them and keeps the choices in the run directory, "fixed" takes XLA's deterministic-ops flag,
# "tuned" autotunes afresh at every start.
GPU_KERNELS = ("saved", "fixed", "tuned")
AUTOTUNE_DIR = "xla_autotune"
_FIXED = "--xla_gpu_exclude_nondeterministic_ops"
_CACHE_DIR = "--xla_gpu_per_fusion_autotune_cache_dir"


def gpu_kernel_flags(
    xla_flags: str, mode: str, run_dir: str | os.PathLike | None = None, several_processes: bool = False
) -> tuple[str, str]:
    """``(XLA_FLAGS, note)``: ``xla_flags`` with what ``mode`` (one of ``GPU_KERNELS``) needs, and
    one line on what the run's GPU programs will do. XLA reads the flags once, when jax starts its
    backend; they do nothing on a CPU or TPU.

    Why it matters: XLA times candidate kernels for each matmul fusion when it compiles, so two
    processes may pick different ones, whose sums differ in the last bits; a resumed run would then
    drift from the run it continues. The train step itself has no atomic scatter-adds on a GPU
    (``elmo_jax.model.gather``), so given the same kernels two processes agree to the bit.

    - "saved": XLA's per-fusion autotuning cache in ``run_dir/xla_autotune``. The first start
      times the candidates and writes one file per fusion (atomically: a temporary file, then a
      rename); every later start reads them, so a resume runs the same kernels. Needs a local
      ``run_dir`` whose path has no spaces (``XLA_FLAGS`` is split on them), and one process
      (``several_processes``: each would time its own candidates); otherwise "fixed".
    - "fixed": ``--xla_gpu_exclude_nondeterministic_ops``: XLA takes each matmul's first candidate
      untimed. No files, but slower (1.5-2.1 ms a step at 128 rows on an H200,
      ``experiments/README.md``).
    - "tuned": neither; a resume may differ in the last bits.

    The deterministic-ops flag, when ``xla_flags`` has it, is kept as set; an autotuning directory
    in ``xla_flags`` is replaced by the run's under "saved". ``set_gpu_kernels`` applies the
    result to this process.
    """
    if mode not in GPU_KERNELS:
        raise ValueError(f"gpu kernels {mode!r}: expected one of {', '.join(GPU_KERNELS)}")
    flags = xla_flags.split()
    if mode == "tuned":
        return xla_flags, "GPU kernels: autotuned at every start; a resume may differ in the last bits"
    why = _why_not_saved(run_dir, several_processes) if mode == "saved" else None
    if mode == "saved" and why is None and run_dir is not None:  # _why_not_saved rules out None
        cache = os.path.join(os.path.abspath(os.fspath(run_dir)), AUTOTUNE_DIR)
        flags = [f for f in flags if f.split("=")[0] != _CACHE_DIR] + [f"{_CACHE_DIR}={cache}"]
        note = f"GPU kernels: autotuned once, the choices kept in {cache}: every start of this run uses them"
        return " ".join(flags), note
    if not any(f.split("=")[0] == _FIXED for f in flags):
        flags.append(f"{_FIXED}=true")
    note = "GPU kernels: XLA's deterministic-ops flag" + (f" (not saved: {why})" if why else "")
    return " ".join(flags), note


def _why_not_saved(run_dir: str | os.PathLike | None, several_processes: bool) -> str | None:
    """Why a run cannot keep its autotuning choices in its directory, or None when it can."""
    if run_dir is None:
        return "no run directory"
    where = os.fspath(run_dir)
    if not is_local(where):
        return f"{where} is not a local path"
    if any(c.isspace() for c in os.path.abspath(where)):
        return f"{os.path.abspath(where)!r} has a space, and XLA_FLAGS is split on spaces"
    if several_processes:
        return "each of the run's processes would time its own candidates"
    return None


def set_gpu_kernels(
    mode: str = "saved", run_dir: str | os.PathLike | None = None, several_processes: bool = False
) -> str:
    """``gpu_kernel_flags`` applied to this process: ``XLA_FLAGS`` in ``os.environ``, and for
    "saved" jax kept from moving XLA's autotuning cache (with its compilation cache on, jax points
    it at a directory of its own, shared by every run). Call it before jax starts its backend (the
    first computation, ``jax.devices()``): XLA reads its flags then. On a machine with an NVIDIA
    driver (``nvidia-smi``) it also makes the autotuning directory, which XLA needs to exist.
    Returns the note.
    """
    flags, note = gpu_kernel_flags(os.environ.get("XLA_FLAGS", ""), mode, run_dir, several_processes)
    cache = next((f.split("=", 1)[1] for f in flags.split() if f.startswith(f"{_CACHE_DIR}=")), None)
    if mode == "saved" and cache is not None and _accelerator() == "cuda12":
        try:  # XLA's documentation: the directory must exist before XLA runs
            os.makedirs(cache, exist_ok=True)
        except OSError as e:
            flags, note = gpu_kernel_flags(os.environ.get("XLA_FLAGS", ""), "fixed")
            note = note + f" (not saved: {cache}: {e.strerror or e})"
    os.environ["XLA_FLAGS"] = flags
    if mode == "saved":
        import jax

        jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    return note


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
