"""Shared fixtures. Helper functions live in tests/helpers.py (importable as ``helpers``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

_TESTS = Path(__file__).resolve().parent
if str(_TESTS) not in sys.path:
    sys.path.insert(0, str(_TESTS))

import helpers  # noqa: E402

# A developer's environment may hold both onnxruntime and onnxruntime-gpu (another package pulls in the
# CPU one): the one-line warning every command would print about it is not what these tests examine.
# tests/test_ort_runtime.py removes this to test the warning itself.
os.environ.setdefault("ONNXFUSE_IGNORE_ORT_CONFLICT", "1")


@pytest.fixture(scope="session")
def testdata_dir() -> Path:
    return helpers.TESTDATA


@pytest.fixture
def ort_compare():
    """``ort_compare(original, optimized, rtol=1e-5, atol=None)``: outputs agree on ONNX Runtime CPU."""
    return helpers.assert_same_outputs
