#!/usr/bin/env python3
"""Write ``onnxfuse/custom_ops/csrc/op_table.gen.h`` from the Python definitions.

One op table for both languages: ``expr.OP_TABLE`` (a row per op: name, arity, operand dtypes,
result rule, attributes, numpy reference, ``ops.h`` function, fast half-precision function) is the
definition; the C++ library takes everything it knows about ops from the header written here:

* ``enum class Op`` and ``kOps`` (name, arity, ``ops.h`` function, operand dtypes as a bit mask of
  ``DType``, result rule, condition-first, attributes with kinds and defaults, fast functions, and
  the CPU *form*: how the CPU kernel and the CUDA generator call the function), in table order, with
  a ``static_assert`` per row that the enumerator and the row agree;
* ``ONNXFUSE_OPS_<FORM>(X)`` lists, one per form, that the CPU kernel expands into its switch cases
  (ops of form ``special`` have hand-written cases; ``-Werror=switch`` catches a missing one);
* ``kLanguageVersion``, ``kProgramHeader``, ``kMaxRank`` (``onnxfuse.custom_ops``);
* the CUDA kernel names and variant flags, the NVRTC options and library search lists
  (``onnxfuse.custom_ops.native``).

Run it after changing any of those (``python tools/gen_op_table.py``; ``--check`` only compares) and
commit the header. ``tests/custom_ops/test_op_table.py`` fails when the committed header is not this
script's output, and when the built library (``native.library_tables()``) disagrees with
:func:`expected_tables` in order or content.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from onnxfuse.custom_ops import LANGUAGE_VERSION, MAX_RANK, expr, native  # noqa: E402

HEADER_OUT = ROOT / "onnxfuse" / "custom_ops" / "csrc" / "op_table.gen.h"
MAX_OP_ATTRS = 2  # Instr carries two numeric attributes (a, b)

# CPU/CUDA call forms: how the function of an op is called, per the compute types of its operands.
FORMS = ("special", "numeric1", "numeric2", "float1", "float2", "compare", "bool1", "bool2")
_ATTR_KINDS = ("float", "bound", "dtype", "word")
_RESULTS = ("same", "bool", "to")


def op_form(spec: expr.OpSpec) -> str:
    """The form of an op: ``float1`` (float operand -> float, float attributes passed after it),
    ``float2``, ``numeric1``/``numeric2`` (float, int32 or int64 -> same), ``compare`` (two operands
    of one dtype -> bool), ``bool1``/``bool2``; ``special`` when none fits (its cases are written by
    hand in csrc: Clip, Gelu, Identity, Cast, Where)."""
    d, kinds = set(spec.dtypes), {a.kind for a in spec.attrs}
    if spec.cond_first or spec.result == "to" or kinds - {"float"}:
        return "special"
    if spec.result == "bool":
        return "compare" if spec.arity == 2 else "special"
    if d == set(expr.FLOAT_DTYPES) and (spec.arity == 1 or not spec.attrs):
        return f"float{spec.arity}" if spec.arity <= 2 else "special"
    if spec.attrs:
        return "special"
    if d == set(expr.FLOAT_DTYPES + expr.INT_DTYPES) and spec.arity <= 2:
        return f"numeric{spec.arity}"
    if d == {"bool"} and spec.arity <= 2:
        return f"bool{spec.arity}"
    return "special"


def _default(a: expr.AttrSpec):
    return None if a.required else a.default


def expected_tables() -> dict:
    """What the library must report (``native.library_tables()``), from the Python definitions."""
    ops = []
    for name, spec in expr.OP_TABLE.items():
        if len(spec.attrs) > MAX_OP_ATTRS:
            raise SystemExit(f"{name}: more than {MAX_OP_ATTRS} attributes (Instr carries two)")
        ops.append({
            "name": name, "arity": spec.arity, "cfunc": spec.c_function,
            "dtypes": [d for d in expr.DTYPES if d in spec.dtypes], "result": spec.result,
            "cond_first": spec.cond_first, "form": op_form(spec), "fast": spec.fast, "fast_bf16": spec.fast_bf16,
            "attrs": [{"name": a.name, "kind": a.kind, "default": _default(a), "choices": list(a.choices)}
                      for a in spec.attrs],
        })
    return {
        "language_version": LANGUAGE_VERSION, "program_header": expr.HEADER, "max_rank": MAX_RANK,
        "dtypes": list(expr.DTYPES), "ops": ops,
        "kernels": [{"variant": v, "name": n, "flag": 1 << k} for k, (v, n) in enumerate(native.KERNELS.items())],
        "index_bits": list(native.INDEX_BITS),
        "nvrtc_options": list(native.NVRTC_OPTIONS), "nvrtc_source_name": native.NVRTC_SOURCE_NAME,
        "nvrtc_library_names": list(native.NVRTC_LIBRARY_NAMES), "nvrtc_root_envs": list(native.NVRTC_ROOT_ENVS),
        "nvrtc_root_default": native.NVRTC_ROOT_DEFAULT, "nvrtc_root_subdirs": list(native.NVRTC_ROOT_SUBDIRS),
    }


def fast_prelude() -> str:
    """The CUDA source of the fast half-precision functions: ``fast_cuda.HEADER``, then each row's
    ``fast_src`` in table order (a function another row's calls comes first: Div before Reciprocal and
    Softsign, Sigmoid before Gelu); every function a row names in ``fast``/``fast_bf16`` is defined."""
    parts = [expr.fast_cuda.HEADER.rstrip("\n")]
    for name, spec in expr.OP_TABLE.items():
        if spec.fast_src:
            parts.append(spec.fast_src.rstrip("\n"))
        for fn in (spec.fast, spec.fast_bf16):
            if fn and f" {fn}(" not in spec.fast_src:
                raise SystemExit(f"{name}: fast function {fn} has no source in its row's fast_src")
    text = "\n".join(parts) + "\n"
    if ")CUDA\"" in text:
        raise SystemExit("fast_src must not contain the raw string's end )CUDA\"")
    return text


def _camel(s: str) -> str:
    return "".join(w.capitalize() for w in s.split("_"))


def _str(s: str) -> str:
    assert all(c.isprintable() and c not in '"\\' for c in s), s
    return f'"{s}"'


def _num(v: float) -> str:
    if math.isinf(v):
        return "HUGE_VAL" if v > 0 else "-HUGE_VAL"
    return repr(float(v))  # shortest text that reads back to the same double


def _strings(xs) -> str:
    return "{" + ", ".join(_str(x) for x in xs) + "}"


def render() -> str:
    t = expected_tables()
    ops = t["ops"]
    dmask = {d: 1 << k for k, d in enumerate(t["dtypes"])}
    out = [
        "// Generated by tools/gen_op_table.py from onnxfuse/custom_ops/expr.py (OP_TABLE),",
        "// onnxfuse/custom_ops/__init__.py and onnxfuse/custom_ops/native.py. Do not edit: change those",
        "// and rerun the script. tests/custom_ops/test_op_table.py checks this file and the built library.",
        "#ifndef ONNXFUSE_OP_TABLE_GEN_H_",
        "#define ONNXFUSE_OP_TABLE_GEN_H_",
        "",
        "#include <cmath>",
        "#include <cstddef>",
        "",
        "namespace onnxfuse {",
        "",
        f"constexpr int kLanguageVersion = {t['language_version']};  // onnxfuse.custom_ops.LANGUAGE_VERSION",
        f"constexpr const char* kProgramHeader = {_str(t['program_header'])};  // expr.HEADER",
        f"constexpr int kMaxRank = {t['max_rank']};  // onnxfuse.custom_ops.MAX_RANK",
        "",
        "// Program dtypes, in DType order (expr.DTYPES).",
        f"enum class DType : int {{ {', '.join(('F32 = 0' if k == 0 else n) for k, n in enumerate(['F32', 'F16', 'BF16', 'I32', 'I64', 'BOOL']))} }};",
        f"constexpr int kNumDTypes = {len(t['dtypes'])};",
        f"inline constexpr const char* kDTypeNames[kNumDTypes] = {_strings(t['dtypes'])};",
        "",
        "// ---------------------------------------------------------------- ops (expr.OP_TABLE order)",
        "enum class Op : int {",
    ]
    assert t["dtypes"] == ["float32", "float16", "bfloat16", "int32", "int64", "bool"], t["dtypes"]
    out += [f"  {o['name']}," for o in ops] + ["  NumOps", "};", ""]
    out += [
        "enum class OpForm : int { " + ", ".join(f"k{_camel(f)}" for f in FORMS) + " };",
        "enum class AttrKind : int { " + ", ".join(f"k{_camel(k)}" for k in _ATTR_KINDS) + " };",
        "enum class ResultRule : int { " + ", ".join(f"k{_camel(r)}" for r in _RESULTS) + " };",
        f"inline constexpr const char* kOpFormNames[] = {_strings(FORMS)};",
        f"inline constexpr const char* kAttrKindNames[] = {_strings(_ATTR_KINDS)};",
        f"inline constexpr const char* kResultRuleNames[] = {_strings(_RESULTS)};",
        f"constexpr int kMaxOpAttrs = {MAX_OP_ATTRS};",
        "",
        "struct AttrInfo {",
        "  const char* name;",
        "  AttrKind kind;",
        "  bool required;",
        "  double def;            // kFloat, kBound",
        "  const char* def_word;  // kWord",
        "  const char* choices;   // kWord: the words, '|'-separated",
        "};",
        "",
        "struct OpInfo {",
        "  const char* name;       // ONNX op name, as written in programs",
        "  int arity;",
        "  const char* cfunc;      // function in ops.h (CPU kernel and CUDA generator share it)",
        "  unsigned dtypes;        // operand dtypes: bit (1 << DType)",
        "  ResultRule result;",
        "  bool cond_first;        // first operand: a bool condition outside `dtypes` (Where)",
        "  OpForm form;            // how the function is called (see ONNXFUSE_OPS_* below)",
        "  const char* fast;       // float16/bfloat16 result: CUDA prelude function instead ('' = cfunc)",
        "  const char* fast_bf16;  // bfloat16 result: another one ('' = fast)",
        "  int nattrs;",
        "  AttrInfo attrs[kMaxOpAttrs];",
        "};",
        "",
        "inline constexpr OpInfo kOps[] = {",
    ]
    for o in ops:
        attrs = []
        for a in o["attrs"]:
            num = a["default"] if a["kind"] in ("float", "bound") and a["default"] is not None else 0.0
            word = a["default"] if a["kind"] == "word" and a["default"] is not None else ""
            attrs.append(f"{{{_str(a['name'])}, AttrKind::k{_camel(a['kind'])}, {str(a['default'] is None).lower()}, "
                         f"{_num(num)}, {_str(word)}, {_str('|'.join(a['choices']))}}}")
        mask = " | ".join(f"0x{dmask[d]:02x}" for d in o["dtypes"])
        out.append(
            f"    {{{_str(o['name'])}, {o['arity']}, {_str(o['cfunc'])}, {mask}, ResultRule::k{_camel(o['result'])}, "
            f"{str(o['cond_first']).lower()}, OpForm::k{_camel(o['form'])}, {_str(o['fast'])}, {_str(o['fast_bf16'])}, "
            f"{len(attrs)}, {{{', '.join(attrs)}}}}},")
    out += [
        "};",
        "static_assert(sizeof(kOps) / sizeof(kOps[0]) == static_cast<size_t>(Op::NumOps), \"one row per op\");",
        "",
        "constexpr bool op_table_streq(const char* a, const char* b) {",
        "  return *a == *b && (*a == '\\0' || op_table_streq(a + 1, b + 1));",
        "}",
        "// Each enumerator names its row (the enum and the rows above are in the same order).",
    ]
    out += [f"static_assert(op_table_streq(kOps[static_cast<int>(Op::{o['name']})].name, {_str(o['name'])}), "
            f"\"Op::{o['name']}\");" for o in ops]
    out += [
        "",
        "// Per form, X(Op, ops.h function) for every op of that form. The CPU kernel expands each list",
        "// into switch cases; ops of form special have hand-written cases.",
    ]
    for f in FORMS:
        items = [f"X({o['name']}, {o['cfunc']})" for o in ops if o["form"] == f]
        if f == "float1":
            for n in range(MAX_OP_ATTRS + 1):
                sel = [f"X({o['name']}, {o['cfunc']})" for o in ops if o["form"] == f and len(o["attrs"]) == n]
                out.append(f"#define ONNXFUSE_OPS_FLOAT1_A{n}(X) " + " ".join(sel))
            continue
        out.append(f"#define ONNXFUSE_OPS_{f.upper()}(X) " + " ".join(items))
    out += [
        "",
        "// ---------------------------------------------------------------- fast half-precision maths",
        "// The fast_src of every OP_TABLE row that has one (onnxfuse/custom_ops/fast_cuda.py), in table order,",
        "// after fast_cuda.HEADER: appended to the CUDA prelude (cuda_codegen.cc).",
        "inline constexpr const char* kFastPrelude = R\"CUDA(",
        *fast_prelude().rstrip("\n").split("\n"),
        ")CUDA\";",
        "",
        "// ---------------------------------------------------------------- CUDA kernels (native.KERNELS)",
        "// Kernel k of a module has variant flag 1 << k and exists as <name>_32 and <name>_64 (index width).",
        f"constexpr int kNumKernels = {len(t['kernels'])};",
        "enum CudaVariant : int {",
    ]
    out += [f"  kVariant{_camel(k['variant'].lower())} = {k['flag']}," for k in t["kernels"]]
    out += [
        f"  kVariantAll = {(1 << len(t['kernels'])) - 1},",
        "};",
        "// Launch index of each kernel (kKernelNames[index]; flag 1 << index).",
        *[f"constexpr int kKernel{_camel(k['variant'].lower())} = {i};" for i, k in enumerate(t["kernels"])],
        f"inline constexpr const char* kKernelNames[kNumKernels] = {_strings(k['name'] for k in t['kernels'])};",
        f"inline constexpr const char* kKernelVariants[kNumKernels] = {_strings(k['variant'] for k in t['kernels'])};",
        f"inline constexpr int kKernelIndexBits[2] = {{{', '.join(str(b) for b in t['index_bits'])}}};",
        "",
        "// ---------------------------------------------------------------- NVRTC (native.NVRTC_*)",
        f"inline constexpr const char* kNvrtcOptions[] = {_strings(t['nvrtc_options'])};",
        f"constexpr int kNumNvrtcOptions = {len(t['nvrtc_options'])};",
        f"constexpr const char* kNvrtcSourceName = {_str(t['nvrtc_source_name'])};",
        f"inline constexpr const char* kNvrtcLibraryNames[] = {_strings(t['nvrtc_library_names'])};",
        f"inline constexpr const char* kNvrtcRootEnvs[] = {_strings(t['nvrtc_root_envs'])};",
        f"constexpr const char* kNvrtcRootDefault = {_str(t['nvrtc_root_default'])};",
        f"inline constexpr const char* kNvrtcRootSubdirs[] = {_strings(t['nvrtc_root_subdirs'])};",
        "",
        "}  // namespace onnxfuse",
        "",
        "#endif  // ONNXFUSE_OP_TABLE_GEN_H_",
        "",
    ]
    assert len(t["index_bits"]) == 2
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="only compare; exit 1 if the header is stale")
    args = ap.parse_args()
    text = render()
    current = HEADER_OUT.read_text() if HEADER_OUT.exists() else ""
    if args.check:
        if current != text:
            print(f"{HEADER_OUT.relative_to(ROOT)} is stale: run python tools/gen_op_table.py", file=sys.stderr)
            return 1
        return 0
    if current != text:
        HEADER_OUT.write_text(text)
        print(f"wrote {HEADER_OUT.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
