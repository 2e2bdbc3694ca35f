"""Fixtures for the bench tests: tiny models written to a temporary folder, the sample profiler trace."""

from __future__ import annotations

import sys
from pathlib import Path

import onnx
import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import tiny_models  # noqa: E402


@pytest.fixture(scope="session")
def sample_trace_path() -> Path:
    return HERE / "data" / "sample_trace_cpu.json"


@pytest.fixture
def tiny_model() -> onnx.ModelProto:
    return tiny_models.conv_relu_add()


@pytest.fixture
def tiny_path(tmp_path, tiny_model) -> Path:
    path = tmp_path / "tiny.onnx"
    onnx.save(tiny_model, str(path))
    return path
