"""contrib-fast-gelu: the tanh approximation of GELU (x·(1 + tanh(√(2/π)(x + 0.044715x³)))/2) → com.microsoft FastGelu,
its coefficients matched within the stated tolerance, near misses refused."""

from __future__ import annotations

import numpy as np
import pytest
from contrib_testlib import fuse, ops, parse, refusals, same_outputs, to_dtype
from test_contrib_gelu import FAST, FAST_FORMS, FAST_TAIL, GELU, HEAD


@pytest.mark.parametrize("form", sorted(FAST_FORMS))
def test_fast_gelu_forms(form):
    model = parse(HEAD + FAST_FORMS[form] + FAST_TAIL + "}")
    out, report = fuse(model, GELU, FAST)
    assert report.counts[FAST.name] == 1, refusals(report)
    assert ops(out) == {"com.microsoft:FastGelu": 1}
    same_outputs(model, out)

def test_fast_gelu_wrong_cubic_coefficient_refused():
    model = parse(HEAD + FAST_FORMS["pow"].replace("0.044715", "0.05") + FAST_TAIL + "}")
    out, report = fuse(model, FAST)
    assert report.counts[FAST.name] == 0
    assert "Tanh" in ops(out)

def test_fast_gelu_wrong_power_refused():
    model = parse(HEAD + FAST_FORMS["pow"].replace("{3.0}", "{2.0}") + FAST_TAIL + "}")
    out, report = fuse(model, FAST)
    assert report.counts[FAST.name] == 0

def test_fast_gelu_double_refused():
    model = to_dtype(parse(HEAD + FAST_FORMS["pow"] + FAST_TAIL + "}"), np.float64)
    out, report = fuse(model, FAST)
    assert report.counts[FAST.name] == 0
    assert any("float64" in r for r in refusals(report, FAST)), refusals(report)
