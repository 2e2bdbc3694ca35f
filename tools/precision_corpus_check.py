#!/usr/bin/env python3
"""``--precision fp16``/``bf16`` over every model of a folder: converted as written, and validated on the CPU.

The promise checked (issue 33): a precision change either writes a well-typed model ONNX Runtime can run or
refuses in one line; never a crash, an ill-typed output, or onnxfuse's own internal error (exit 5). For each
``*.onnx`` under the folder (``tools/fetch_ort_corpus.py`` writes ONNX Runtime's test models there):

* default: ``onnxfuse.optimize(model, precision=P, validate=False)`` must return a model that passes ONNX's
  strict, type-checking inference and, for bf16, has every bfloat16 node on a CUDA bfloat16 kernel
  (:func:`onnxfuse.precision_kernels.nodes_without_a_bfloat16_kernel`), or raise onnxfuse's one-line error;
* ``--validate`` (fp16 only: bf16 is validated on CUDA): ``onnxfuse optimize M out.onnx --precision P
  --provider cpu --no-bench -q`` per model, its exit codes counted; every exit other than 0 and 1 (the
  original does not run here, or holds no float32) is printed with the last lines it wrote. Exit 3 (a
  validation failure, its culprit named) is a finding to read; exit 5 or a timeout fails the check.

Prints one line per finding and the counts. docs/benchmarks.md 5.53 ran it at both precisions:

    python tools/precision_corpus_check.py /tmp/ort-corpus --precision bf16
    python tools/precision_corpus_check.py /tmp/ort-corpus --precision fp16 --validate -j 2
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def converted(path: Path, precision: str) -> tuple[str, str]:
    """(outcome, detail) of converting one model without validation."""
    import onnx

    import onnxfuse
    from onnxfuse.errors import OnnxfuseError
    from onnxfuse.precision_kernels import nodes_without_a_bfloat16_kernel
    from onnxfuse.rewrites.facts.inference import onnx_inferred

    try:
        model = onnx.load(str(path))
    except Exception as exc:  # noqa: BLE001  (not a model: not what is checked here)
        return "not loadable", str(exc)[:200]
    try:
        result = onnxfuse.optimize(model, precision=precision, validate=False, bench=False)
    except OnnxfuseError as exc:
        one_line = "\n" not in str(exc)
        kind = "internal error" if type(exc).__name__ == "InternalError" else f"refused ({type(exc).__name__})"
        return (kind if one_line else "refused in several lines"), str(exc)[:300]
    except Exception as exc:  # noqa: BLE001  (a crash is the finding)
        return "crash", f"{type(exc).__name__}: {str(exc)[:300]}"
    try:
        if precision == "bf16":
            missing = nodes_without_a_bfloat16_kernel(result.model)
            if missing:
                return "no bf16 kernel", ", ".join(missing[:5])
        else:
            onnx_inferred(result.model, strict=True, check_type=True)
    except Exception as exc:  # noqa: BLE001  (onnx raises several types)
        return "ill-typed output", " ".join(str(exc).split())[:300]
    return "ok", ""


def validated(path: Path, precision: str, out_dir: str) -> tuple[str, str]:
    """(exit code, last lines) of the command line validating one model on the CPU."""
    out = Path(out_dir) / f"{abs(hash(str(path)))}.onnx"
    command = [sys.executable, "-m", "onnxfuse", "optimize", str(path), str(out), "--precision", precision,
               "--provider", "cpu", "--no-bench", "-q"]
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=ROOT)
    except subprocess.TimeoutExpired:
        return "timeout", ""
    out.unlink(missing_ok=True)
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip() and not line.startswith("\x1b")]
    return str(run.returncode), " | ".join(lines[-2:])[:400]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--precision", choices=["fp16", "bf16"], default="fp16")
    ap.add_argument("--validate", action="store_true", help="validate on the CPU through the command line (fp16)")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="models at once (--validate: one process each)")
    args = ap.parse_args(argv)
    if args.validate and args.precision == "bf16":
        ap.error("--validate: bf16 is validated on CUDA only")
    warnings.filterwarnings("ignore")
    paths = sorted(args.folder.rglob("*.onnx"))
    findings, counts = [], collections.Counter()
    with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        check = (lambda p: validated(p, args.precision, tmp)) if args.validate else (lambda p: converted(p, args.precision))
        for path, (outcome, detail) in zip(paths, pool.map(check, paths)):
            counts[outcome] += 1
            bad = (outcome not in ("0", "1") if args.validate else
                   outcome not in ("ok", "not loadable") and not outcome.startswith("refused ("))
            if bad:
                findings.append(f"{outcome:<18} {path.relative_to(args.folder)}: {detail}")
    print("\n".join(findings))
    print(f"\n{len(paths)} models, --precision {args.precision}{' validated on the CPU' if args.validate else ''}")
    for outcome, n in sorted(counts.items()):
        print(f"| {outcome} | {n} |")
    internal = counts["5"] + counts["timeout"] if args.validate else len(findings)
    return 1 if internal else 0


if __name__ == "__main__":
    sys.exit(main())
