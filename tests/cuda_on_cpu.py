"""CUDA kernels run on the CPU, so that a test without a GPU runs the very
source that CuPy would compile, not a retelling of it in NumPy.

:class:`RawKernel` takes what ``cupy.RawKernel`` takes (the source and the
kernel's name), compiles it with g++ against ``cuda_on_cpu.h`` (CUDA's
built-ins: each GPU thread a fiber with its stack, run in turn until it
waits at a barrier or a warp's shuffle) and launches it as CuPy does,
``kernel(grid, block, args, shared_mem=...)``, on NumPy arrays, a block
after another.  What a GPU would get wrong, it refuses rather than runs:

- an argument of another type than the kernel's parameter: an array of
  another dtype, one not C-ordered, a Python ``int`` or ``float`` (which
  CuPy passes as 64 bits whatever the parameter);
- a write past either end of an array (each lies between guards, checked
  after the launch); reads past them, and of dynamic shared memory not yet
  written, read NaN (or -1);
- a ``__syncthreads()`` that not every thread reaches (a round in which no
  fiber moves), a full-mask shuffle in a partial warp.

Fibers take turns only at barriers, so a race between threads never shows
here: what it checks is each thread's arithmetic and indexing.

Timing means nothing here; the kernel's registers and spills are nvcc's
to tell (``bench/gpu_checks.py`` and the archive's records).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

HEADER = Path(__file__).with_name("cuda_on_cpu.h")
COMPILER = shutil.which("g++")
#: Why the kernels can't run here, or None where they can: g++, and glibc's
#: ucontext for the fibers.
UNAVAILABLE = (
    "CUDA kernels run on the CPU on Linux only (glibc's ucontext)"
    if not sys.platform.startswith("linux")
    else None
    if COMPILER
    else "no C++ compiler (g++) on this machine to run CUDA kernels on the CPU"
)
FLAGS = ("-std=c++20", "-O1", "-fno-strict-aliasing", "-fPIC", "-Wno-unknown-pragmas")
#: Bytes of guard on each side of an array.
GUARD = 64

_C_TYPES = {
    "float": np.float32,
    "double": np.float64,
    "int": np.int32,
    "unsigned": np.uint32,
    "unsigned int": np.uint32,
    "long long": np.int64,
    "unsigned long long": np.uint64,
    "size_t": np.uint64,
}
_DYNAMIC_SHARED = re.compile(r"extern\s+__shared__\s+(?:__align__\(\d+\)\s+)?([\w ]+?)\s+(\w+)\s*\[\s*\]\s*;")


class KernelFailure(RuntimeError):
    """What a GPU would have done wrong, or deadlocked on."""


class RawKernel:
    """``cupy.RawKernel(source, name)``'s call on the CPU, over NumPy arrays."""

    def __init__(self, source: str, name: str) -> None:
        if UNAVAILABLE:
            raise RuntimeError(UNAVAILABLE)
        self.source, self.name = source, name
        self.parameters = list(_parameters(source, name))
        self._launch = _compiled(source, name, tuple(text for text, _, _ in self.parameters))

    def __call__(self, grid: tuple[int, ...], block: tuple[int, ...], args: tuple[Any, ...], *, shared_mem: int = 0):
        if len(args) != len(self.parameters):
            raise TypeError(f"{self.name} takes {len(self.parameters)} arguments, got {len(args)}")
        holders, guarded = [], []
        for argument, (text, base, pointer) in zip(args, self.parameters):
            expected = np.dtype(base)
            if pointer:
                if not isinstance(argument, np.ndarray) or argument.dtype != expected:
                    raise TypeError(f"{self.name}: {text!r} given {_describe(argument)}")
                if not argument.flags.c_contiguous:
                    raise TypeError(f"{self.name}: {text!r} given an array that is not C-ordered")
                buffer = np.full(argument.nbytes + 2 * GUARD, 0xFF, dtype=np.uint8)
                buffer[GUARD : GUARD + argument.nbytes] = argument.reshape(-1).view(np.uint8)
                guarded.append((argument, buffer, text, "const" in text.split("*")[0]))
                holders.append(ctypes.c_void_p(buffer.ctypes.data + GUARD))
            else:
                if not isinstance(argument, np.generic) or argument.dtype != expected:
                    raise TypeError(f"{self.name}: {text!r} given {_describe(argument)}")
                holders.append(np.array(argument))
        addresses = (ctypes.c_void_p * max(1, len(holders)))(
            *(ctypes.addressof(h) if isinstance(h, ctypes.c_void_p) else h.ctypes.data for h in holders)
        )
        grid, block = _dims(grid), _dims(block)
        failure = self._launch(*grid, *block, ctypes.c_size_t(shared_mem), addresses)
        if failure:
            raise KernelFailure(f"{self.name}: {failure.decode()}")
        for argument, buffer, text, constant in guarded:
            if not (np.all(buffer[:GUARD] == 0xFF) and np.all(buffer[GUARD + argument.nbytes :] == 0xFF)):
                raise KernelFailure(f"{self.name}: wrote past an end of {text!r}")
            if not constant:
                argument.reshape(-1).view(np.uint8)[...] = buffer[GUARD : GUARD + argument.nbytes]


def _describe(argument: Any) -> str:
    if isinstance(argument, (np.ndarray, np.generic)):
        return f"{type(argument).__name__} of {argument.dtype}"
    return f"a Python {type(argument).__name__} (CuPy passes it as 64 bits)"


def _dims(sizes: tuple[int, ...]) -> tuple[int, int, int]:
    sizes = tuple(int(size) for size in sizes) + (1,) * (3 - len(sizes))
    if len(sizes) != 3 or min(sizes) < 1:
        raise ValueError(f"grid and block sizes are 1 to 3 positive numbers, got {sizes}")
    return sizes


@functools.cache
def _parameters(source: str, name: str) -> list[tuple[str, Any, bool]]:
    """``(declared type, NumPy dtype of the value or pointee, is a pointer)``
    for each of the kernel's parameters, read from its signature in the
    preprocessed source (where ``#if`` chooses between kernels)."""
    preprocessed = subprocess.run(
        [COMPILER, "-E", "-P", "-x", "c++", "-"], input=source, capture_output=True, text=True, check=True
    ).stdout
    source = preprocessed
    signature = re.search(
        r"__global__\s+void\s+(?:__launch_bounds__\([^)]*\)\s+)?" + re.escape(name) + r"\s*\(([^)]*)\)", source
    )
    if signature is None:
        raise ValueError(f"no __global__ kernel {name!r} in the source")
    typedefs = dict((alias, actual) for actual, alias in re.findall(r"typedef\s+([\w ]+?)\s+(\w+)\s*;", source))
    parameters = []
    for declaration in signature.group(1).split(","):
        words = declaration.replace("__restrict__", " ").replace("*", " * ").split()
        text = " ".join(words[:-1])
        base = " ".join(word for word in words[:-1] if word not in ("const", "*"))
        base = typedefs.get(base, base)
        if base not in _C_TYPES:
            raise ValueError(f"{name}: a parameter of type {text!r}, which the emulator does not know")
        parameters.append((text, _C_TYPES[base], "*" in words))
    return parameters


@functools.cache
def _compiled(source: str, name: str, parameter_types: tuple[str, ...]) -> Any:
    """The launch of ``name`` from ``source`` compiled into a library (kept
    in the temporary directory under its hash, so that reruns skip g++)."""
    source = _DYNAMIC_SHARED.sub(r"\1* const \2 = reinterpret_cast<\1*>(emu::dynamic_shared);", source)
    call = ", ".join(f"*({text}*)args[{index}]" for index, text in enumerate(parameter_types))
    launcher = f"""
extern "C" const char* emu_launch(unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                                  size_t shared, void** args) {{
    static std::string failure;
    failure = emu::run({{gx, gy, gz}}, {{bx, by, bz}}, shared, [&] {{ {name}({call}); }});
    return failure.c_str();
}}
"""
    text = source + launcher
    header = _precompiled_header()
    digest = hashlib.sha256("\0".join((text, header.read_text(), *FLAGS)).encode()).hexdigest()[:24]
    library = header.parent / f"{name}-{digest}.so"
    if not library.exists():
        source_file = library.with_suffix(f".{os.getpid()}.cpp")
        source_file.write_text(text)
        partial = library.with_suffix(f".{os.getpid()}.so")
        _compile("-shared", "-include", str(header), str(source_file), "-o", str(partial), what=name)
        source_file.unlink()
        os.replace(partial, library)
    launch = ctypes.CDLL(str(library)).emu_launch
    launch.restype = ctypes.c_char_p
    launch.argtypes = [ctypes.c_uint] * 6 + [ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)]
    return launch


@functools.cache
def _precompiled_header() -> Path:
    """cuda_on_cpu.h copied under its hash into the temporary directory, with
    its precompiled form beside it: g++ then spends half a second a kernel,
    not two, parsing the standard library's headers."""
    text = HEADER.read_text()
    digest = hashlib.sha256("\0".join((text, *FLAGS)).encode()).hexdigest()[:24]
    directory = Path(tempfile.gettempdir()) / "attnx-cuda-on-cpu"
    directory.mkdir(exist_ok=True)
    header = directory / f"cuda_on_cpu-{digest}.h"
    if not header.with_suffix(".h.gch").exists():
        partial = header.with_suffix(f".{os.getpid()}.h")
        partial.write_text(text)
        os.replace(partial, header)
        compiled = header.with_suffix(f".{os.getpid()}.gch")
        _compile("-x", "c++-header", str(header), "-o", str(compiled), what="cuda_on_cpu.h")
        os.replace(compiled, header.with_suffix(".h.gch"))
    return header


def _compile(*arguments: str, what: str) -> None:
    result = subprocess.run([COMPILER, *FLAGS, *arguments], capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"g++ could not compile {what}:\n{result.stderr[-4000:]}")
