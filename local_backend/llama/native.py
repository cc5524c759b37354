"""Build and load the int8 VNNI kernels of the w8a16/w8a8 modes (``q8kernel.c``): one C file, compiled once per machine.

The kernel needs an x86-64 CPU with AVX-512 (F, BW, VL) and VNNI and a C compiler (``$CC``,
else ``cc``). It is compiled on first use into ``<model cache>/kernels/q8kernel-<hash>.so``
(the hash covers the source, the flags and the compiler's version, so an edit or another
compiler builds a new file; the write is atomic, so concurrent starts are safe) and called
through ctypes, which releases the GIL for the call. ``kernel()`` returns None with a reason
when the CPU or the compiler is missing; ``--quantize auto`` then falls back to ``int8`` (and
``w8a8`` to oneDNN's int8 matmul).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ABI_VERSION", "CPU_FLAGS", "Kernel", "kernel", "unavailable_reason"]

SOURCE = Path(__file__).with_name("q8kernel.c")
ABI_VERSION = 4
CPU_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
_CFLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni")
_BUILD_TIMEOUT_S = 120

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class Kernel:
    """The loaded library: ``pack``, ``linear`` and ``attend`` as ctypes functions (see q8kernel.c)."""

    path: Path
    pack: ctypes._CFuncPtr
    linear: ctypes._CFuncPtr
    attend: ctypes._CFuncPtr


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _build(cc: str, version: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *_CFLAGS, "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {SOURCE.name} ({version.splitlines()[:1]}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _library_path(version: str) -> Path:
    from ..models import cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_CFLAGS).encode() + version.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"q8kernel-{digest}.so"


@functools.cache
def _load() -> tuple[Kernel | None, str]:
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the int8 VNNI kernel needs Linux on x86-64, not {platform.system()} {platform.machine()}"
    missing = [f for f in CPU_FLAGS if f not in _cpu_flags()]
    if missing:
        return None, f"the int8 VNNI kernel needs AVX-512 VNNI; this CPU lacks {', '.join(missing)}"
    cc = _compiler()
    if cc is None:
        return None, "the int8 VNNI kernel is compiled on first use and no C compiler was found (set $CC or install cc)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        path = _library_path(version)
        if not path.exists():
            _build(cc, version, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"the int8 VNNI kernel could not be built or loaded: {exc}"
    if lib.q8_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI {lib.q8_abi_version()}, expected {ABI_VERSION}"
    lib.q8_pack.argtypes = [_P, _I64, _I64, _I64, _I64, _P]
    lib.q8_pack.restype = None
    lib.q8_linear.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, ctypes.c_float, ctypes.c_int, ctypes.c_int, _P, _I64, ctypes.c_int, ctypes.c_int]
    lib.q8_linear.restype = ctypes.c_int
    lib.q8_attend.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _I64, _P, _I64, ctypes.c_int]
    lib.q8_attend.restype = ctypes.c_int
    return Kernel(path, lib.q8_pack, lib.q8_linear, lib.q8_attend), ""


def kernel() -> Kernel | None:
    """The loaded kernel, built on first call; None when this machine cannot run it."""
    return _load()[0]


def unavailable_reason() -> str:
    """Why ``kernel()`` is None ("" when it is not)."""
    return _load()[1]
