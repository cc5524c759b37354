"""Build and load the int8 kernels of the w8a16/w8a8 modes (``q8kernel.c``), once per instruction set.

One C source, two builds, picked from the CPU's flags at run time:

- ``avx512_vnni``: AVX-512 F/BW/VL and VNNI (Intel since Cascade Lake, AMD since Zen 4);
- ``avx2``: AVX2 and FMA (x86-64 servers of the last decade: AMD EPYC Rome/Milan, Intel since Haswell).

Both compute the same bits (q8kernel.c says how), so the choice changes speed, never an answer.
``kernel()`` returns the best one this CPU runs; ``kernel("avx2")`` a given one (AVX2 code runs on
AVX-512 machines too, which is how its tests and benchmarks run everywhere). ``$LOCAL_BACKEND_KERNEL``
(``avx512_vnni`` or ``avx2``) makes that choice for ``kernel()`` too.

The kernel needs Linux on x86-64 and a C compiler (``$CC``, else ``cc``). It is compiled on first
use into ``<model cache>/kernels/q8kernel-<isa>-<hash>.so`` (the hash covers the source, the flags
and the compiler's version, so an edit or another compiler builds a new file; the write is atomic,
so concurrent starts are safe; ~1 s) and called through ctypes, which releases the GIL for each
call. Where no build can run (another CPU, no compiler), ``kernel()`` is None with a reason and
``--quantize auto`` falls back to a torch mode (quantize.py).
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

__all__ = ["ABI_VERSION", "ISAS", "ISA_FLAGS", "Kernel", "cpu_flags", "kernel", "kernel_choice", "unavailable_reason"]

SOURCE = Path(__file__).with_name("q8kernel.c")
ABI_VERSION = 5
ISAS = ("avx512_vnni", "avx2")  # best first
ISA_FLAGS = {
    "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avx2": ("avx2", "fma"),
}
_ISA_CFLAGS = {
    "avx512_vnni": ("-DQ8_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni"),
    "avx2": ("-DQ8_AVX2", "-mavx2", "-mfma"),
}
# -ffp-contract=off: no a * b + c fused unless written so, which is what keeps both builds' bits equal.
_CFLAGS = ("-O3", "-std=gnu11", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off")
_BUILD_TIMEOUT_S = 120
ENV_CHOICE = "LOCAL_BACKEND_KERNEL"

_P, _I64 = ctypes.c_void_p, ctypes.c_int64


@dataclass(frozen=True)
class Kernel:
    """One loaded build: ``pack``, ``linear`` and ``attend`` as ctypes functions (see q8kernel.c).

    ``block`` is the packed weights' block of output channels (32 for AVX-512, 8 for AVX2)."""

    isa: str
    path: Path
    block: int
    pack: Callable[..., None]
    linear: Callable[..., int]
    attend: Callable[..., int]


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def _compiler() -> str | None:
    cc = os.environ.get("CC") or "cc"
    return shutil.which(cc)


def _flags(isa: str) -> tuple[str, ...]:
    return (*_CFLAGS, *_ISA_CFLAGS[isa])


def _build(cc: str, isa: str, version: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([cc, *_flags(isa), "-o", tmp, str(SOURCE), "-lm"], capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise RuntimeError(f"{cc} failed to build {SOURCE.name} for {isa} ({version.splitlines()[:1]}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _library_path(isa: str, version: str) -> Path:
    from ..models import cache_dir

    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(_flags(isa)).encode() + version.encode()).hexdigest()[:16]
    return cache_dir() / "kernels" / f"q8kernel-{isa}-{digest}.so"


@functools.cache
def _load(isa: str) -> tuple[Kernel | None, str]:
    if isa not in ISA_FLAGS:
        return None, f"unknown kernel {isa!r}: one of {', '.join(ISAS)}"
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        return None, f"the int8 kernels need Linux on x86-64, not {platform.system()} {platform.machine()}"
    missing = [f for f in ISA_FLAGS[isa] if f not in cpu_flags()]
    if missing:
        return None, f"the {isa} kernel needs {'/'.join(ISA_FLAGS[isa])}; this CPU lacks {', '.join(missing)}"
    cc = _compiler()
    if cc is None:
        return None, "the int8 kernels are compiled on first use and no C compiler was found (set $CC or install cc)"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        path = _library_path(isa, version)
        if not path.exists():
            _build(cc, isa, version, path)
        lib = ctypes.CDLL(str(path))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        return None, f"the {isa} kernel could not be built or loaded: {exc}"
    if lib.q8_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI {lib.q8_abi_version()}, expected {ABI_VERSION}"
    lib.q8_pack.argtypes = [_P, _I64, _I64, _I64, _I64, _P]
    lib.q8_pack.restype = None
    lib.q8_linear.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, ctypes.c_float, ctypes.c_int, ctypes.c_int, _P, _I64, ctypes.c_int, ctypes.c_int]
    lib.q8_linear.restype = ctypes.c_int
    lib.q8_attend.argtypes = [_P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I64, _P, _I64, ctypes.c_int]
    lib.q8_attend.restype = ctypes.c_int
    lib.q8_block.restype = ctypes.c_int64
    return Kernel(isa, path, int(lib.q8_block()), lib.q8_pack, lib.q8_linear, lib.q8_attend), ""


def kernel_choice() -> str | None:
    """The ISA ``$LOCAL_BACKEND_KERNEL`` asks for (None: the best this CPU runs)."""
    choice = os.environ.get(ENV_CHOICE, "").strip()
    return choice or None


def kernel(isa: str | None = None) -> Kernel | None:
    """The loaded kernel for ``isa`` (default: ``$LOCAL_BACKEND_KERNEL``, else the best this CPU runs),
    built on first call; None when this machine cannot run it."""
    isa = isa or kernel_choice()
    if isa is not None:
        return _load(isa)[0]
    for candidate in ISAS:
        found = _load(candidate)[0]
        if found is not None:
            return found
    return None


def unavailable_reason(isa: str | None = None) -> str:
    """Why ``kernel(isa)`` is None ("" when it is not); for the best-available choice, every build's reason."""
    isa = isa or kernel_choice()
    if isa is not None:
        return _load(isa)[1]
    if kernel() is not None:
        return ""
    return "; ".join(_load(candidate)[1] for candidate in ISAS)
