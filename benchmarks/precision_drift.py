#!/usr/bin/env python3
"""How far a plain float16 / bfloat16 cast of the zoo's exports drifts from float32, every op's result rounded.

The figures behind the default drift budgets (``onnxfuse/validate/drift_budget.py``: 2e-2 for float16,
0.16 for bfloat16; docs/benchmarks.md 5.52). Each model is exported as the zoo exports it (random weights,
``benchmarks/zoo.py``; torch and transformers make the model, never onnxfuse), converted with no rewrite
(``onnxfuse.precision.convert_to_fp16``), and run on ONNX Runtime's CPU provider with every low-precision
result rounded as ONNX specifies (``onnxfuse.validate.onnx_semantics.per_op_rounding``: the CPU provider would
otherwise compute chains in float32), on one full and one padded sample. Prints, per model and type, each
output's normalized max error (max |got - ref| / max |ref|) and cosine, worst over the samples.

    python benchmarks/precision_drift.py gpt2_small@sdpa bert_base@eager --out /tmp/precision-drift
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("models", nargs="+", help="zoo names, e.g. gpt2_small@sdpa bert_base@eager")
    ap.add_argument("--out", type=Path, default=Path("precision-drift"), help="folder for the exports")
    ap.add_argument("--opset", type=int, default=14)
    args = ap.parse_args(argv)

    import onnx

    import zoo
    from onnxfuse.precision import BFLOAT16, FLOAT16, convert_to_fp16
    from onnxfuse.runtime.session import run_samples
    from onnxfuse.validate.drift_budget import output_drift
    from onnxfuse.validate.onnx_semantics import per_op_rounding

    args.out.mkdir(parents=True, exist_ok=True)
    print("| model | type | output | normalized max error | cosine |\n|---|---|---|---:|---:|")
    for name in args.models:
        base, attention = zoo.split_variant(name)
        spec = zoo.SPECS[base]
        path = args.out / f"{name}.onnx"
        if not path.exists():
            zoo.export(spec, zoo.build_module(spec, attention=attention), path, args.opset)
        model = onnx.load(str(path))
        samples = [spec.feeds(2)]
        if "attention_mask" in samples[0]:  # and a right-padded row
            padded = {k: v.copy() for k, v in samples[0].items()}
            padded["attention_mask"][1, padded["attention_mask"].shape[1] // 2:] = 0
            samples.append(padded)
        reference = run_samples(model, samples, "cpu")
        for target in (FLOAT16, BFLOAT16):
            converted, _ = convert_to_fp16(model, target=target)
            rounded = per_op_rounding(converted, target.elem)
            drift = output_drift(reference, run_samples(rounded, samples, "cpu"))
            for output, d in drift.items():
                print(f"| {name} | {target.name} | {output} | {d.error:.3g} | {d.cosine:.6f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
