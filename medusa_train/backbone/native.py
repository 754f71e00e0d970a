"""Kernels compiled for this CPU: what its instruction sets are, and building a C++ source for them.

The backbone's decoding-step kernels (the row kernel, ``rows.cpp``; the step attention, ``step_attention.cpp``) are
written for AVX2 with FMA and for AVX-512 (with AVX512-BF16's instructions where the CPU has them, and the row kernel
with AMX's tiles where it has those). Each is compiled
on first use for the instruction set torch itself runs here (``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 CPU gives the
AVX2 build, as it gives torch's AVX2 kernels: how an AVX2 machine's code paths are measured on a newer one), with
pybind11 and ATen's ``parallel_for`` only (~10 s), kept in torch's ``~/.cache/torch_extensions`` under a name that
holds a digest of the source, the flags and torch's version (a cache shared between machines or environments never
hands one the other's build), and imported from there afterwards. Without a compiler the build is a string saying
why, and the callers keep torch's own paths.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

import torch

#: the instruction sets the kernels are written for, by torch's name for the CPU's capability, and their flags
ISA_FLAGS = {"AVX512": ["-mavx512f", "-mavx512dq", "-mavx2", "-mfma"], "AVX2": ["-mavx2", "-mfma"]}
#: added where an AVX-512 CPU has AVX512-BF16 (the kernels' bfloat16 paths)
BF16_FLAGS = ["-mavx512bf16"]
#: added where it also has AMX's tiles with their bfloat16 products (Intel's from Sapphire Rapids: the row kernel's
#: bfloat16 path on tiles)
AMX_FLAGS = ["-mamx-tile", "-mamx-bf16"]


def switched_off(variable: str) -> bool:
    """True when the environment variable ``variable`` says ``0`` / ``off`` / ``false`` / ``no``."""
    return os.environ.get(variable, "1").strip().lower() in ("0", "off", "false", "no")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where unknown), read once a process."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_vendor() -> str | None:
    """The CPU's vendor as Linux names it (``GenuineIntel``, ``AuthenticAMD``, ...), or None where unknown."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("vendor_id"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def cpu_isa() -> str | None:
    """The instruction set the kernels are built for on this CPU (``AVX512`` / ``AVX2``), or None: torch's own
    choice of code paths."""
    capability = torch.backends.cpu.get_cpu_capability().upper()
    for isa in ISA_FLAGS:
        if capability.startswith(isa):
            return isa
    return None


def build_flags(isa: str) -> list[str]:
    """The compiler's instruction-set flags for ``isa`` on this CPU (AVX512-BF16's added where it has it, and AMX's
    where it has that too)."""
    if isa != "AVX512" or "avx512_bf16" not in cpu_flags():
        return ISA_FLAGS[isa]
    amx = {"amx_tile", "amx_bf16"} <= cpu_flags()
    return ISA_FLAGS[isa] + BF16_FLAGS + (AMX_FLAGS if amx else [])


def build_for_cpu(stem: str, source: Path, switch: str | None = None):
    """``source`` compiled for this CPU's instruction set (AVX512-BF16's and AMX's flags tried first where it has them,
    then without AMX's, then without both), or a string saying why there is none (``switch``: an environment variable
    that turns it off)."""
    if switch and switched_off(switch):
        return f"off ({switch}={os.environ[switch]})"
    isa = cpu_isa()
    if isa is None:
        return f"not built: this CPU's capability is {torch.backends.cpu.get_cpu_capability()}, not AVX2 or AVX-512"
    # a compiler without AMX's flags, or without AVX512-BF16's, still builds the rest
    full = build_flags(isa)
    tries = [full, [x for x in full if x not in AMX_FLAGS], ISA_FLAGS[isa]]
    tries = [f for i, f in enumerate(tries) if f not in tries[:i]]  # each set of flags once
    failures = []
    for flags in tries:
        built = build(stem, source, isa, flags)
        if not isinstance(built, str):
            return built
        failures.append(built)
    return failures[0]


def build(stem: str, source: Path, isa: str, flags: list[str]):
    """``source`` built (or imported, built before) with ``flags`` as ``medusa_train_<stem>_<isa>_<digest>``, or a
    string saying why it could not be."""
    name = f"medusa_train_{stem}_{isa.lower()}_{_digest(source, flags)}"
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        built = Path(_get_build_directory(name, verbose=False)) / f"{name}.so"
        if built.is_file():  # built before for this source, torch and CPU: imported at once, no build step run
            try:
                return _import_built(name, built)
            except ImportError:  # another process is writing it: torch's loader waits for that build
                pass
        _ninja_on_path()
        return load(name=name, sources=[str(source)], extra_cflags=["-O3", "-fopenmp", *flags],
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as err:  # no compiler, no ninja, a read-only cache: the callers stay on torch's paths
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        return f"not built ({type(err).__name__}: {first[:200]})"


def _import_built(name: str, path: Path):
    """The module compiled earlier at ``path`` (torch's own loader asks ninja whether to rebuild first: seconds in
    every process, a rebuild whenever two environments share the cache)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ninja_on_path() -> None:
    """torch builds with the ``ninja`` command: where only the pip package has it (a venv used without being
    activated), its folder goes on this process's PATH."""
    import shutil

    if shutil.which("ninja") is None:
        try:
            import ninja
        except ImportError:
            return
        os.environ["PATH"] = os.pathsep.join([ninja.BIN_DIR, os.environ.get("PATH", "")])


def _digest(source: Path, flags: list[str]) -> str:
    key = source.read_bytes() + f"|{torch.__version__}|{' '.join(flags)}".encode()
    return hashlib.sha256(key).hexdigest()[:10]
