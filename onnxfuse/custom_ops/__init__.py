"""The FusedElementwise custom op: its contract and the library that implements it.

A ``FusedElementwise`` node (domain :data:`DOMAIN`, op type :data:`OP_TYPE`, opset
:data:`OPSET_VERSION`) evaluates a small elementwise program, carried as the readable string
attribute :data:`PROGRAM_ATTR` (language: ``docs/program-language.md``), over its inputs broadcast
together. Any number of inputs (of mixed dtypes) and outputs; every output has the broadcast shape.

The op is implemented by a C++ shared library built with the package (``_fused_ops.so``, see
``setup.py``) that ONNX Runtime loads by path: a CPU kernel that interprets the program over blocks
of elements, and a CUDA kernel generated from the program and compiled with NVRTC for the GPU in
hand on first use (cached in memory and under ``$XDG_CACHE_HOME/onnxfuse/kernels``;
``ONNXFUSE_KERNEL_CACHE=0`` disables the disk cache).

This module imports nothing heavy: ``onnxruntime`` is imported only by :func:`session_options`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from onnxfuse.ort_runtime import import_onnxruntime

if TYPE_CHECKING:  # pragma: no cover
    import onnx
    import onnxruntime

#: ONNX domain of the fused op (add ``onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION)`` to models).
DOMAIN = "ai.onnxfuse"
#: ONNX op type of the fused op.
OP_TYPE = "FusedElementwise"
#: Opset version of :data:`DOMAIN` that the library implements.
OPSET_VERSION = 1
#: Name of the node's string attribute holding the program.
PROGRAM_ATTR = "program"
#: Version of the program language (the number in the ``onnxfuse.elementwise N`` header).
LANGUAGE_VERSION = 1
#: Largest broadcast rank (the largest input rank) a node may have. The library refuses higher
#: ranks with an error (at session creation when the ranks are known, else when the node runs):
#: its CPU kernel and CUDA kernels keep coordinates and strides in arrays of this size
#: (``kMaxRank`` in csrc/broadcast.h, returned by the library's ``onnxfuse_max_rank()``; a test
#: checks the two agree). fuse-elementwise leaves ops of higher rank unfused.
MAX_RANK = 16

#: ONNX op type of the concatenating form of the fused op (same domain and opset). A ``FusedConcat`` node
#: holds K programs (string attributes ``program_0`` .. ``program_{K-1}``, :func:`concat_program_attr`)
#: and an int attribute :data:`CONCAT_AXIS_ATTR` (non-negative). Its inputs are segment 0's program
#: inputs, then segment 1's, and so on (as many as each program declares). Output 0 is the
#: concatenation along the axis of every segment's program output 0, each segment evaluated over its own
#: inputs exactly as a FusedElementwise node of that program would; then, segment by segment, each
#: program's outputs 1.. (with that segment's shape). Why: a Concat of FusedElementwise results costs a
#: read and a write of everything it concatenates; writing each result into its slice of the
#: concatenation costs nothing more than writing it (issue 34; inductor does the same).
CONCAT_OP_TYPE = "FusedConcat"
#: Name of a FusedConcat node's int attribute: the axis (non-negative, below the rank).
CONCAT_AXIS_ATTR = "axis"


def concat_program_attr(k: int) -> str:
    """Name of a FusedConcat node's string attribute holding segment ``k``'s program."""
    return f"program_{k}"


#: Model metadata key written by ``onnxfuse optimize``: JSON ``{fused node name: {original tensor name:
#: program value}}``, the tensors of the original model that each FusedElementwise node computes
#: internally. ``onnxfuse diff --intermediates`` uses it to compare through fused regions.
FUSED_VALUES_KEY = "onnxfuse.fused_values"

#: Environment variable: use this library file instead of the one built with the package.
LIBRARY_ENV = "ONNXFUSE_LIBRARY"
#: Environment variable read by the library: ':'-separated libnvrtc files to try first.
NVRTC_ENV = "ONNXFUSE_NVRTC_PATH"

_LIBRARY_NAME = "_fused_ops.so"

__all__ = [
    "DOMAIN", "OP_TYPE", "CONCAT_OP_TYPE", "CONCAT_AXIS_ATTR", "concat_program_attr", "OPSET_VERSION", "PROGRAM_ATTR", "LANGUAGE_VERSION", "MAX_RANK",
    "LibraryNotFoundError", "library_path", "session_options", "make_node", "opset_import",
    "nvrtc_library_path", "FUSED_VALUES_KEY", "expose_fused_values",
]


class LibraryNotFoundError(RuntimeError):
    """The compiled custom-op library is missing (the package was not built/installed)."""


def library_path() -> str:
    """Absolute path of the compiled FusedElementwise library for ONNX Runtime.

    ``$ONNXFUSE_LIBRARY`` overrides it. Raises :class:`LibraryNotFoundError` with the fix when the
    library was not built.
    """
    override = os.environ.get(LIBRARY_ENV)
    if override:
        if not os.path.isfile(override):
            raise LibraryNotFoundError(f"{LIBRARY_ENV}={override} does not exist")
        return os.path.abspath(override)
    path = Path(__file__).resolve().parent / _LIBRARY_NAME
    if not path.is_file():
        raise LibraryNotFoundError(
            f"onnxfuse's custom-op library is missing ({path}). It is compiled when the package is "
            'installed: reinstall with `pip install -e ".[dev,cpu]"` (or `pip install .`) from the '
            "source tree, which needs a C++17 compiler (g++ or clang++), or install a prebuilt wheel."
        )
    return str(path)


def nvrtc_library_path() -> str | None:
    """libnvrtc from the ``nvidia-cuda-nvrtc`` wheel, if installed (else None)."""
    # import cycle: importing onnxfuse.custom_ops.native imports this module
    from onnxfuse.custom_ops.native import NVRTC_LIBRARY_NAMES

    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        for sub in ("cu13/lib", "cuda_nvrtc/lib", "cu12/lib"):
            d = Path(root) / sub
            if not d.is_dir():
                continue
            for name in NVRTC_LIBRARY_NAMES:
                if (d / name).is_file():
                    return str(d / name)
    return None


def _export_nvrtc_path() -> None:
    """Let the library find the wheel's libnvrtc (the system's is tried after it)."""
    found = nvrtc_library_path()
    if not found:
        return
    current = os.environ.get(NVRTC_ENV, "")
    parts = [p for p in current.split(":") if p]
    if found not in parts:
        os.environ[NVRTC_ENV] = ":".join(parts + [found])


def session_options(base: "onnxruntime.SessionOptions | None" = None) -> "onnxruntime.SessionOptions":
    """``onnxruntime.SessionOptions`` with the FusedElementwise library registered.

    ``base`` is modified and returned when given. Registering twice on the same options is
    harmless to avoid but not needed: call this once per options object.
    """
    ort = import_onnxruntime()
    opts = base if base is not None else ort.SessionOptions()
    _export_nvrtc_path()
    opts.register_custom_ops_library(library_path())
    return opts


def opset_import() -> "onnx.OperatorSetIdProto":
    """The opset import a model using the fused op needs."""
    # start-up: it loads numpy, onnx, which importing this module does not
    import onnx.helper

    return onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION)


def make_node(
    program: str,
    inputs: Sequence[str],
    outputs: Sequence[str],
    name: str | None = None,
    **kwargs: Any,
) -> "onnx.NodeProto":
    """A FusedElementwise ``NodeProto`` running ``program`` (text) on ``inputs``."""
    # start-up: it loads numpy, onnx, which importing this module does not
    import onnx.helper

    return onnx.helper.make_node(
        OP_TYPE, list(inputs), list(outputs), name=name, domain=DOMAIN,
        **{PROGRAM_ATTR: program}, **kwargs,
    )


def expose_fused_values(model: "onnx.ModelProto") -> tuple["onnx.ModelProto", int]:
    """A copy of ``model`` whose FusedElementwise nodes also output the original tensors they compute
    internally (per :data:`FUSED_VALUES_KEY`), under their original names and with their types
    recorded, so that they can be compared with the original model's; and how many were exposed.

    The program gains ``output`` lines for those values (the language allows any number of outputs,
    each with the broadcast shape), so the node computes exactly what it did, plus the extra stores.
    """
    # start-up: it loads numpy, onnx, which importing this module does not
    import onnx

    # import cycle (importing onnxfuse.custom_ops.expr imports this module); also loads numpy
    from onnxfuse.custom_ops import expr

    meta = next((p.value for p in model.metadata_props if p.key == FUSED_VALUES_KEY), None)
    if not meta:
        return model, 0
    try:
        per_node = json.loads(meta)
    except ValueError:
        return model, 0
    out = onnx.ModelProto()
    out.CopyFrom(model)
    existing = {o for n in out.graph.node for o in n.output} | {i.name for i in out.graph.input}
    added = 0
    for node in out.graph.node:
        values = per_node.get(node.name) if node.op_type == OP_TYPE and node.domain == DOMAIN else None
        if not isinstance(values, dict):
            continue
        attr = next((a for a in node.attribute if a.name == PROGRAM_ATTR), None)
        if attr is None:
            continue
        text = attr.s.decode("utf-8", "surrogateescape")  # a foreign program may hold any byte
        dtypes = dict(re.findall(r"^\s*(\w+)\s*:\s*(\w+)\s*=", text, flags=re.M))
        extra = [(tensor, value) for tensor, value in values.items()
                 if tensor not in existing and value in dtypes]
        if not extra:
            continue
        attr.s = (text.rstrip("\n") + "\n" + "".join(f"output {v}\n" for _, v in extra)).encode("utf-8", "surrogateescape")
        for tensor, value in extra:
            node.output.append(tensor)
            out.graph.value_info.append(onnx.helper.make_tensor_value_info(
                tensor, expr.ONNX_DTYPE[dtypes[value]], None))
            existing.add(tensor)
            added += 1
    return out, added
