"""The library's own declaration of ONNX Runtime's C API (csrc/ort_abi.h) against real headers.

``tests/cpp/ort_abi_check.cc`` includes a real ``onnxruntime_c_api.h`` and ours and asserts at
compile time that every declared OrtApi entry and OrtCustomOp field has the real offset and type,
every enumerator the real value. Here it is compiled against real headers of several releases,
fetched for the tests only with the ordinary package clients and cached:

* ``$ONNXFUSE_ORT_REFERENCE_HEADERS``: ':'-separated folders holding ``onnxruntime_c_api.h``;
* the npm package ``com.github.asus4.onnxruntime`` 0.4.9 (ONNX Runtime's own headers, API 29),
  fetched with ``npm pack``, sha256-checked;
* ONNX Runtime 1.21's headers left by earlier onnxfuse builds in the user cache, where present.

A mutated copy of ours (one entry moved, one signature changed) must fail the same check, so the
check is shown to be able to fail. The committed header must be what tools/gen_ort_abi.py writes
from the newest reference header.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "onnxfuse" / "custom_ops" / "csrc"
CHECK = ROOT / "tests" / "cpp" / "ort_abi_check.cc"
NPM_PACKAGE = "com.github.asus4.onnxruntime@0.4.9"
NPM_SHA256 = "e59788788818fdde1b2e522e766a21ba0f7d8391de55737abf81e32cc801785d"
NPM_HEADER_DIR = "package/Plugins/iOS~/onnxruntime.xcframework/ios-arm64/onnxruntime.framework/Headers/"

CXX = os.environ.get("CXX", "g++")
pytestmark = pytest.mark.skipif(shutil.which(CXX.split()[0]) is None, reason="needs a C++ compiler")


def _cache() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onnxfuse" / "ort-reference-headers"


def _npm_headers() -> Path | None:
    dest = _cache() / "npm-asus4-0.4.9"
    if (dest / "onnxruntime_c_api.h").is_file():
        return dest
    if shutil.which("npm") is None:
        return None
    work = _cache() / "download"
    work.mkdir(parents=True, exist_ok=True)
    try:
        r = subprocess.run(["npm", "pack", NPM_PACKAGE, "--silent"], cwd=work, capture_output=True,
                           text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    tgz = work / (r.stdout.strip().splitlines() or ["missing"])[-1]
    if r.returncode != 0 or not tgz.is_file():
        return None
    try:
        digest = hashlib.sha256(tgz.read_bytes()).hexdigest()
        if digest != NPM_SHA256:
            pytest.fail(f"{tgz.name}: sha256 {digest} is not the pinned {NPM_SHA256}")
        staging = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        with tarfile.open(tgz) as tar:
            for m in tar.getmembers():
                if m.isfile() and m.name.startswith(NPM_HEADER_DIR) and m.name.endswith(".h"):
                    (staging / Path(m.name).name).write_bytes(tar.extractfile(m).read())
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
    finally:
        tgz.unlink(missing_ok=True)
    return dest


def _api_version(folder: Path) -> int:
    text = (folder / "onnxruntime_c_api.h").read_text()
    return int(re.search(r"#define ORT_API_VERSION (\d+)", text).group(1))


def reference_headers() -> list[Path]:
    found: list[Path] = []
    for d in filter(None, os.environ.get("ONNXFUSE_ORT_REFERENCE_HEADERS", "").split(":")):
        if (Path(d) / "onnxruntime_c_api.h").is_file():
            found.append(Path(d))
    npm = _npm_headers()
    if npm:
        found.append(npm)
    legacy = _cache().parent  # onnxfuse builds before 0.1 fetched Debian's 1.21 headers here
    found += [p for p in sorted(legacy.glob("ort-headers-*")) if (p / "onnxruntime_c_api.h").is_file()]
    unique = {}
    for p in found:
        unique.setdefault(_api_version(p), p)
    return [unique[v] for v in sorted(unique)]


@pytest.fixture(scope="module")
def headers() -> list[Path]:
    found = reference_headers()
    if not found:
        pytest.skip("no real ONNX Runtime headers reachable (npm) or given in ONNXFUSE_ORT_REFERENCE_HEADERS")
    return found


def _compile_check(real: Path, ours: Path) -> subprocess.CompletedProcess:
    return subprocess.run([*CXX.split(), "-std=c++17", "-fsyntax-only", f"-I{real}", f"-I{ours}", str(CHECK)],
                          capture_output=True, text=True)


def test_declarations_match_every_reference_release(headers):
    for real in headers:
        r = _compile_check(real, CSRC)
        assert r.returncode == 0, f"API {_api_version(real)}:\n{r.stderr[-3000:]}"


def _requested_version() -> int:
    return int(re.search(r"#define ONNXFUSE_ORT_API_VERSION (\d+)", (CSRC / "ort_abi.h").read_text()).group(1))


def test_requested_api_version_is_the_newest_since_note():
    # KernelInfoGetAllocator (ONNX Runtime 1.18) is the newest entry the library calls.
    assert _requested_version() == 18
    assert "KernelInfoGetAllocator" in (CSRC / "ort_abi.h").read_text()


@pytest.mark.parametrize("mutation", [
    ("void* unused_66_to_71[6]", "void* unused_66_to_71[5]"),                      # entries after it move
    ("size_t index, const OrtValue** out", "size_t index, OrtValue** out"),       # a signature changes
    ("ORT_INVALID_GRAPH = 10", "ORT_INVALID_GRAPH = 11"),                           # an enumerator value
    ("int(* GetVariadicInputMinArity)", "size_t(* GetVariadicInputMinArity)"),       # an OrtCustomOp field
])
def test_check_fails_on_a_wrong_declaration(headers, tmp_path, mutation):
    text = (CSRC / "ort_abi.h").read_text()
    old, new = mutation
    assert old in text
    (tmp_path / "ort_abi.h").write_text(text.replace(old, new))
    r = _compile_check(headers[-1], tmp_path)
    assert r.returncode != 0 and "static assertion failed" in r.stderr


def test_committed_header_is_what_the_generator_writes(headers, tmp_path):
    newest = headers[-1]
    source = re.search(r"API version (\d+)\.", (CSRC / "ort_abi.h").read_text()).group(1)
    if _api_version(newest) != int(source):
        pytest.skip(f"the committed header was written from API {source}; newest reference is {_api_version(newest)}")
    r = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_ort_abi.py"), str(newest / "onnxruntime_c_api.h"),
                        "--header-out", str(tmp_path / "ort_abi.h"), "--check-out", str(tmp_path / "check.cc")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert (tmp_path / "ort_abi.h").read_text() == (CSRC / "ort_abi.h").read_text()
    assert (tmp_path / "check.cc").read_text() == CHECK.read_text()
