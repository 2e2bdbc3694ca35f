"""cancel-cast-roundtrip: Cast to a wider type and straight back is removed, bitwise equal; narrowing
round trips (which lose values) stay."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_testlib import fuse, ops, parse, refusals

import helpers
from onnxfuse.rewrites.fold.cancel_cast_roundtrip import CancelCastRoundtrip, widens_exactly

RULE = CancelCastRoundtrip()


def roundtrip(src: str, wide: int, back: int, dst: str = None):
    body = f"w = Cast <to = {wide}> (x)\nb = Cast <to = {back}> (w)\ny = Abs(b)"
    return parse(f"g ({src}[4,6] x) => ({dst or src}[4,6] y) {{\n{body}\n}}")


@pytest.mark.parametrize("src, np_type, wide, back", [
    ("float16", np.float16, 1, 10),  # float16 → float32 → float16 (Llama's fp16 Softmax)
    ("float16", np.float16, 11, 10),
    ("float", np.float32, 11, 1),
    ("int32", np.int32, 7, 6),
    ("uint8", np.uint8, 5, 2),  # uint8 → int16 → uint8
], ids=["f16-f32", "f16-f64", "f32-f64", "i32-i64", "u8-i16"])
def test_widening_roundtrip_goes_and_values_are_bitwise_equal(src, np_type, wide, back):
    m = roundtrip(src, wide, back)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report)
    assert "Cast" not in ops(out), ops(out)
    rng = np.random.default_rng(0)
    if np.issubdtype(np_type, np.floating):
        x = (rng.standard_normal((4, 6)) * 1e4).astype(np_type)
        x[0, :3] = [np.inf, -np.inf, np.nan]
    else:
        info = np.iinfo(np_type)
        x = rng.integers(info.min, info.max, size=(4, 6), endpoint=True).astype(np_type)
    want, got = helpers.run_ort(m, {"x": x})["y"], helpers.run_ort(out, {"x": x})["y"]
    assert want.dtype == got.dtype and np.array_equal(want, got, equal_nan=np.issubdtype(np_type, np.floating))


@pytest.mark.parametrize("src, wide, back", [
    ("float", 10, 1),  # float32 → float16 → float32 rounds
    ("int32", 3, 6),  # int32 → int8 → int32 wraps
    ("int8", 2, 3),  # int8 → uint8 → int8: not a widening (negative values change on the way)
    ("float", 6, 1),  # float → int32 → float truncates
], ids=["f32-f16", "i32-i8", "i8-u8", "f32-i32"])
def test_narrowing_roundtrip_stays(src, wide, back):
    m = roundtrip(src, wide, back)
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 0
    assert ops(out)["Cast"] == 2
    assert any("not a widening" in r for r in refusals(report, RULE)), refusals(report, RULE)


def test_a_wide_value_read_elsewhere_keeps_its_cast():
    body = "w = Cast <to = 1> (x)\nb = Cast <to = 10> (w)\ny = Abs(b)\nz = Neg(w)"
    m = parse(f"g (float16[4,6] x) => (float16[4,6] y, float[4,6] z) {{\n{body}\n}}")
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1
    assert ops(out)["Cast"] == 1
    x = np.random.default_rng(1).standard_normal((4, 6)).astype(np.float16)
    want, got = helpers.run_ort(m, {"x": x}), helpers.run_ort(out, {"x": x})
    assert all(np.array_equal(want[k], got[k]) for k in want)


def test_widens_exactly_table():
    f16, f32, f64 = (np.dtype(t) for t in (np.float16, np.float32, np.float64))
    assert widens_exactly(f16, f32) and widens_exactly(f32, f64) and not widens_exactly(f32, f16)
    assert widens_exactly(np.dtype(np.uint16), np.dtype(np.int32)) and not widens_exactly(np.dtype(np.uint16), np.dtype(np.int16))
    assert not widens_exactly(np.dtype(np.int64), f64)  # 2⁵³ + 1 is not a float64


@pytest.mark.parametrize("src, np_type, to", [("float16", np.float16, 10), ("float", np.float32, 1),
                                              ("int64", np.int64, 7)], ids=["f16", "f32", "i64"])
def test_a_cast_to_its_own_type_goes(src, np_type, to):
    """``Cast(x, to=type(x))`` changes no value: what --precision fp16 leaves of an exporter's float32 step."""
    m = parse(f"g ({src}[4,6] x) => ({src}[4,6] y) {{\nc = Cast <to = {to}> (x)\ny = Abs(c)\n}}")
    out, report = fuse(m, RULE)
    assert report.counts[RULE.name] == 1, refusals(report)
    assert "Cast" not in ops(out), ops(out)
    x = (np.random.default_rng(1).standard_normal((4, 6)) * 100).astype(np_type)
    assert np.array_equal(helpers.run_ort(m, {"x": x})["y"], helpers.run_ort(out, {"x": x})["y"])
    # a Cast to another type stays
    other = parse(f"g ({src}[4,6] x) => (double[4,6] y) {{\nc = Cast <to = 11> (x)\ny = Abs(c)\n}}")
    out, report = fuse(other, RULE)
    assert report.counts.get(RULE.name, 0) == 0 and ops(out)["Cast"] == 1
