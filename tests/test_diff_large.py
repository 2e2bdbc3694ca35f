"""``diff`` on large outputs: compared piece by piece, with the numbers of the whole-tensor comparison,
and a memory peak of a few times the output (was about 22x: ``compare_arrays``' float64 temporaries
on the stacked samples, then ``error_histogram``'s)."""

from __future__ import annotations

import math
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import large_models as lm
from onnxfuse.runtime import compare as comparator
from onnxfuse.runtime.compare import Tolerance

#: diff's tolerance: dtype-aware defaults, the looser of the two sides' dtypes.
DIFF = Tolerance(both_dtypes=True)


def _pair(seed: int, shape=(37, 1001)):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(shape).astype(np.float32) * 50
    b = a + rng.standard_normal(shape).astype(np.float32) * 1e-3
    b[rng.random(shape) < 0.01] += 1.0  # some elements beyond tolerance
    a[0, 3], b[5, 7], a[9, 9], b[9, 9] = np.nan, np.inf, -np.inf, -np.inf
    return a, b


@pytest.mark.parametrize("samples", [1, 3])
def test_pieces_give_the_numbers_of_the_whole(monkeypatch, samples):
    pairs = [_pair(seed) for seed in range(samples)]
    refs, gots = [p[0] for p in pairs], [p[1] for p in pairs]
    whole, whole_hist = comparator.compare_tensor("t", refs, gots, DIFF, histogram=True)
    monkeypatch.setattr(comparator, "CHUNK_ELEMENTS", 4096)  # ~9 pieces per sample, boundaries mid-row
    pieces, pieces_hist = comparator.compare_tensor("t", refs, gots, DIFF, histogram=True)
    a, b = whole.to_dict(), pieces.to_dict()
    for key in ("mean_abs", "rms", "cosine"):
        assert math.isclose(a.pop(key), b.pop(key), rel_tol=1e-9), key
    assert a == b
    assert whole_hist == pieces_hist
    assert not whole.passed and whole.nonfinite_mismatches == 2 * samples


def test_pieces_with_explicit_tolerances_and_integers(monkeypatch):
    a = np.arange(10_000, dtype=np.int64).reshape(100, 100)
    b = a.copy()
    b[42, 17] += 3
    x, y = _pair(7)
    whole, _ = comparator.compare_tensor("i", [a], [b], DIFF)
    w, _ = comparator.compare_tensor("x", [x], [y], Tolerance(rtol=1e-2, atol=0.5, both_dtypes=True))
    monkeypatch.setattr(comparator, "CHUNK_ELEMENTS", 777)
    pieces, _ = comparator.compare_tensor("i", [a], [b], DIFF)
    p, _ = comparator.compare_tensor("x", [x], [y], Tolerance(rtol=1e-2, atol=0.5, both_dtypes=True))
    assert pieces.worst_index == whole.worst_index == [42, 17]
    assert pieces.max_abs == whole.max_abs == 3 and pieces.mismatch_fraction == whole.mismatch_fraction
    assert p.worst_index == w.worst_index and p.mismatch_fraction == w.mismatch_fraction
    assert (w.rtol, w.atol) == (p.rtol, p.atol) == (1e-2, 0.5)


PEAK = textwrap.dedent("""
    import sys
    import onnxfuse
    def status(key):
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key))
    onnxfuse.diff(sys.argv[1], sys.argv[1])  # imports and ONNX Runtime warmed up
    base = status("VmRSS:")
    onnxfuse.diff(sys.argv[2], sys.argv[2])
    print(base, status("VmHWM:"))
""")


def _expand_model(path, rows: int):
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1024])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [rows, 1024])
    shape = helper.make_tensor("shape", TensorProto.INT64, [2], [rows, 1024])
    g = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["e"]), helper.make_node("Sin", ["e"], ["y"])],
                          "g", [x], [y], [shape])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))


def test_diff_peak_memory_is_a_few_times_the_output(tmp_path):
    rows = 16384  # 64 MiB of float32 output
    _expand_model(tmp_path / "small.onnx", 1)
    _expand_model(tmp_path / "big.onnx", rows)
    out = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "small.onnx"), str(tmp_path / "big.onnx")],
                         env=lm.child_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    base, peak = map(int, out.stdout.split())
    output = rows * 1024 * 4
    assert peak - base < 8 * output, f"peak {(peak - base) / output:.1f}x the output"
