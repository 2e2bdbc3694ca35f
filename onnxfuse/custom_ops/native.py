"""ctypes access to the C++ library's own functions (not ONNX Runtime's) and to NVRTC, for tests and
tools; and the constants the library is generated from.

The CUDA code generator is C++ (``csrc/cuda_codegen.cc``): the library that ONNX Runtime loads
generates and compiles its kernels at session creation, so it cannot depend on Python. This module
reaches that generator, the C++ parser and the kernel counters through the library's exported
``onnxfuse_*`` C functions, and NVRTC directly, so a machine without a GPU can still check that every
generated kernel compiles:

>>> src = cuda_source(program_text)                    # doctest: +SKIP
>>> ptx = compile_ptx(src, arch="compute_90")          # doctest: +SKIP

The constants below (kernel names and variant flags, NVRTC options and search lists) are defined
once, here: ``tools/gen_op_table.py`` writes them, with the op table (``expr.OP_TABLE``), the
language version and the rank limit, into ``csrc/op_table.gen.h``, which the C++ code uses;
``tests/custom_ops/test_op_table.py`` checks the committed header and asks the built library what it
was compiled with (:func:`library_tables`).

Kernel variants (bit flags; the flag of the k-th kernel of :data:`KERNELS` is ``1 << k``;
:data:`VARIANT_ALL` is what the library compiles at run time): :data:`VARIANT_FAST_VEC` (every input
has the output's shape or one element; 128-bit loads and stores, scalar tail),
:data:`VARIANT_FAST_SCALAR` (same, any alignment), :data:`VARIANT_BROADCAST` (per-input strides),
:data:`VARIANT_BROADCAST_VEC` (per-input strides, innermost dim a multiple of the vector width,
inputs contiguous or broadcast along it: 128-bit loads and stores). Each comes with a 32-bit and a
64-bit index kernel (:data:`KERNEL_NAMES`).

Ops whose declared dtype is float16/bfloat16 and whose ``expr.OP_TABLE`` row names a ``fast``
function (Exp, Sigmoid, Tanh, Reciprocal, Div, Softsign, Gelu[approximate=tanh]) are generated with
fast hardware approximations (``ofx_fast_*`` in the source; error bounds stated there, all far below
half precision's rounding); float32 ops keep the accurate functions of ``csrc/ops.h``.
"""

from __future__ import annotations

import ctypes
import json
import os
from functools import lru_cache

from . import library_path, nvrtc_library_path

__all__ = [
    "KERNELS", "INDEX_BITS", "KERNEL_NAMES",
    "VARIANT_FAST_VEC", "VARIANT_FAST_SCALAR", "VARIANT_BROADCAST", "VARIANT_BROADCAST_VEC", "VARIANT_ALL",
    "NVRTC_OPTIONS", "NVRTC_SOURCE_NAME", "NVRTC_LIBRARY_NAMES", "NVRTC_ROOT_ENVS", "NVRTC_ROOT_DEFAULT",
    "NVRTC_ROOT_SUBDIRS", "nvrtc_candidates",
    "NvrtcError", "NvrtcNotFoundError", "check_program", "cuda_source", "compile_ptx",
    "nvrtc_version", "kernel_stats", "library_tables",
]

# ------------------------------------------------------------------------------ shared constants
#: The kernels of one CUDA module, in launch-index order: variant -> kernel name. The flag of the
#: k-th is ``1 << k``; its C++ enumerator is ``kVariant`` + the variant in CamelCase.
KERNELS: dict[str, str] = {
    "FAST_VEC": "ofx_fast_vec",
    "FAST_SCALAR": "ofx_fast_scalar",
    "BROADCAST": "ofx_bcast",
    "BROADCAST_VEC": "ofx_bcast_vec",
}
#: Index widths: every kernel exists as ``<name>_32`` and ``<name>_64``.
INDEX_BITS: tuple[int, ...] = (32, 64)
VARIANT_FAST_VEC, VARIANT_FAST_SCALAR, VARIANT_BROADCAST, VARIANT_BROADCAST_VEC = (1 << k for k in range(len(KERNELS)))
VARIANT_ALL = (1 << len(KERNELS)) - 1
#: variant flag -> (32-bit index kernel, 64-bit index kernel)
KERNEL_NAMES: dict[int, tuple[str, ...]] = {
    1 << k: tuple(f"{name}_{bits}" for bits in INDEX_BITS) for k, name in enumerate(KERNELS.values())
}

#: NVRTC options besides ``--gpu-architecture=...`` (the library's, and :func:`compile_ptx`'s).
NVRTC_OPTIONS: tuple[str, ...] = ("--std=c++17", "--fmad=true", "-DONNXFUSE_NVRTC=1")
#: The file name NVRTC is given for the source (it appears in NVRTC's messages).
NVRTC_SOURCE_NAME = "onnxfuse_fused.cu"
#: libnvrtc file names, newest first: tried by name (the dynamic loader's search), then in each root.
NVRTC_LIBRARY_NAMES: tuple[str, ...] = ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so")
#: Environment variables naming CUDA installations, tried before the default one.
NVRTC_ROOT_ENVS: tuple[str, ...] = ("CUDA_HOME", "CUDA_PATH")
NVRTC_ROOT_DEFAULT = "/usr/local/cuda"
#: Library folders inside a CUDA installation.
NVRTC_ROOT_SUBDIRS: tuple[str, ...] = ("/lib64/", "/targets/x86_64-linux/lib/", "/targets/sbsa-linux/lib/")


def nvrtc_candidates() -> list[str]:
    """libnvrtc files to try, in order: ``$ONNXFUSE_NVRTC_PATH`` (':'-separated), the names alone,
    then every name in every CUDA root. The library (``nvrtc_candidates()`` in
    ``csrc/cuda_runtime.cc``) walks the same list from the same constants."""
    out = [p for p in os.environ.get("ONNXFUSE_NVRTC_PATH", "").split(":") if p]
    out += list(NVRTC_LIBRARY_NAMES)
    roots = [os.environ[e] for e in NVRTC_ROOT_ENVS if os.environ.get(e)] + [NVRTC_ROOT_DEFAULT]
    out += [root + sub + name for root in roots for sub in NVRTC_ROOT_SUBDIRS for name in NVRTC_LIBRARY_NAMES]
    return out


class NvrtcError(RuntimeError):
    """NVRTC rejected a source; the message carries NVRTC's log."""


class NvrtcNotFoundError(RuntimeError):
    """No libnvrtc could be loaded."""


@lru_cache(maxsize=1)
def _lib() -> ctypes.CDLL:
    lib = ctypes.CDLL(library_path())
    lib.onnxfuse_check_program.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]
    lib.onnxfuse_check_program.restype = ctypes.c_int
    lib.onnxfuse_cuda_source.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t]
    lib.onnxfuse_cuda_source.restype = ctypes.c_long
    lib.onnxfuse_cuda_stats.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.onnxfuse_cuda_stats.restype = ctypes.c_long
    lib.onnxfuse_op_table.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
    lib.onnxfuse_op_table.restype = ctypes.c_long
    return lib


def _json_from(fn) -> dict:
    size = 4096
    while True:  # the library returns the length it needs
        buf = ctypes.create_string_buffer(size)
        need = fn(buf, len(buf))
        if need < size:
            return json.loads(buf.value.decode())
        size = need + 1


def library_tables() -> dict:
    """What the built library was compiled with, from its generated header (``csrc/op_table.gen.h``):
    ``language_version``, ``max_rank``, ``ops`` (one dict per op in ``enum Op`` order: name, arity,
    ops.h function, dtypes, result rule, attributes, CPU form, fast functions), ``kernels``,
    ``nvrtc_*``. ``tests/custom_ops/test_op_table.py`` compares it with the Python tables."""
    return _json_from(_lib().onnxfuse_op_table)


def check_program(program: str) -> str | None:
    """The C++ parser's verdict: None if ``program`` is valid, else its ``line N: ...`` message."""
    err = ctypes.create_string_buffer(4096)
    ok = _lib().onnxfuse_check_program(program.encode(), err, len(err))
    return None if ok else err.value.decode(errors="backslashreplace")


def cuda_source(program: str, variant: int = VARIANT_ALL, placed: bool = False) -> str:
    """The CUDA source the library generates for ``program`` (``variant``: bit mask of kernels;
    ``placed``: the kernels of a FusedConcat segment, storing output 0 into its slice)."""
    lib = _lib()
    data = program.encode()
    need = lib.onnxfuse_cuda_source(data, variant, int(placed), None, 0)
    if need < 0:
        raise ValueError(f"invalid program: {check_program(program)}")
    buf = ctypes.create_string_buffer(need + 1)
    lib.onnxfuse_cuda_source(data, variant, int(placed), buf, len(buf))
    return buf.value.decode()


def kernel_stats() -> dict:
    """Counters of the library loaded in this process: NVRTC compiles, disk/memory cache hits and
    writes, disk entries rejected (failed verification, never loaded: ``disk_rejects``,
    ``last_disk_reject``), why the cache folder was refused (``disk_refused``, "" when used),
    compile and load milliseconds, target architecture, entry name, cache folder."""
    return _json_from(_lib().onnxfuse_cuda_stats)


# --------------------------------------------------------------------------------------------- NVRTC

@lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    candidates = nvrtc_candidates()
    wheel = nvrtc_library_path()
    if wheel:  # right after $ONNXFUSE_NVRTC_PATH's files, where session_options() puts it for the library
        n_env = len([p for p in os.environ.get("ONNXFUSE_NVRTC_PATH", "").split(":") if p])
        candidates.insert(n_env, wheel)
    errors = []
    for c in candidates:
        try:
            lib = ctypes.CDLL(c)
        except OSError as e:
            errors.append(f"{c}: {e}")
            continue
        P = ctypes.c_void_p
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(P), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                           P, P]
        lib.nvrtcCompileProgram.argtypes = [P, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcGetProgramLogSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetProgramLog.argtypes = [P, ctypes.c_char_p]
        lib.nvrtcGetPTXSize.argtypes = [P, ctypes.POINTER(ctypes.c_size_t)]
        lib.nvrtcGetPTX.argtypes = [P, ctypes.c_char_p]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(P)]
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]
        lib.nvrtcVersion.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_int)]
        lib._onnxfuse_path = c
        return lib
    raise NvrtcNotFoundError("no libnvrtc found (install the nvidia-cuda-nvrtc wheel: "
                             "pip install nvidia-cuda-nvrtc); tried: " + "; ".join(errors))


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the NVRTC found by :func:`compile_ptx`."""
    lib = _nvrtc()
    a, b = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
    return a.value, b.value


def compile_ptx(source: str, arch: str = "compute_90", options: tuple[str, ...] = ()) -> str:
    """Compile CUDA ``source`` with NVRTC (same options as the library) and return the PTX.

    Raises :class:`NvrtcError` with NVRTC's log when it does not compile.
    """
    lib = _nvrtc()
    prog = ctypes.c_void_p()
    r = lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), NVRTC_SOURCE_NAME.encode(), 0, None, None)
    if r != 0:
        raise NvrtcError(f"nvrtcCreateProgram: {lib.nvrtcGetErrorString(r).decode()}")
    try:
        opts = [f"--gpu-architecture={arch}", *NVRTC_OPTIONS, *options]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        r = lib.nvrtcCompileProgram(prog, len(opts), arr)
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetProgramLog(prog, log)
        if r != 0:
            raise NvrtcError(f"NVRTC failed ({lib.nvrtcGetErrorString(r).decode()}):\n"
                             f"{log.value.decode(errors='replace')}")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value + 1)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
