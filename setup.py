"""Build onnxfuse's FusedElementwise custom-op library for ONNX Runtime.

The C++ library (onnxfuse/custom_ops/csrc) is compiled as a setuptools Extension named
``onnxfuse.custom_ops._fused_ops``. It is a plain shared library that ONNX Runtime loads by path
(``SessionOptions.register_custom_ops_library``); Python never imports it.

It needs ONNX Runtime's C/C++ API headers, which no PyPI wheel ships. They are found, in order:

1. ``ONNXRUNTIME_INCLUDE_DIR``: a folder holding ``onnxruntime_cxx_api.h`` (or its
   ``onnxruntime/`` subfolder);
2. a cache of earlier fetches (``$XDG_CACHE_HOME/onnxfuse/ort-headers`` or
   ``~/.cache/onnxfuse/ort-headers``);
3. Debian's ``libonnxruntime-dev`` 1.21 package (trixie), downloaded with apt-get through the
   machine's own configured Debian mirror (without touching the system's apt configuration),
   checked against a pinned sha256 and unpacked with ``dpkg -x``.

No CUDA headers are needed: the library declares the few CUDA driver API and NVRTC entry points it
uses and dlopens ``libcuda.so.1`` / libnvrtc at run time, only when a CUDA kernel is created.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "onnxfuse" / "custom_ops" / "csrc"

ORT_DEB_PACKAGE = "libonnxruntime-dev"
ORT_DEB_VERSION_PREFIX = "1.21"
ORT_DEB_SUITE = "trixie"
ORT_DEB_SHA256 = "14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08"
DEBIAN_SOURCES = Path("/etc/apt/sources.list.d/debian.sources")
DEBIAN_KEYRING = Path("/usr/share/keyrings/debian-archive-keyring.gpg")

HOW_TO_FIX = (
    "Set ONNXRUNTIME_INCLUDE_DIR to a folder containing ONNX Runtime's C/C++ API headers "
    "(onnxruntime_c_api.h, onnxruntime_cxx_api.h, onnxruntime_lite_custom_op.h, version 1.21 or "
    "newer; e.g. the include/ folder of an onnxruntime release archive from "
    "https://github.com/microsoft/onnxruntime/releases) and build again."
)


class HeaderFetchError(RuntimeError):
    pass


def _log(msg: str) -> None:
    print(f"onnxfuse build: {msg}", file=sys.stderr, flush=True)


def _cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "onnxfuse"


def _normalize_include_dir(path: Path) -> Path | None:
    """Return the folder that directly holds onnxruntime_cxx_api.h, if any."""
    for cand in (path, path / "onnxruntime", path / "onnxruntime" / "core" / "session",
                 path / "include" / "onnxruntime", path / "include"):
        if (cand / "onnxruntime_cxx_api.h").is_file():
            return cand
    return None


def _debian_mirror_uri() -> str:
    """The first Debian archive URI configured on this machine (never hard-coded here)."""
    if not DEBIAN_SOURCES.is_file():
        raise HeaderFetchError(f"{DEBIAN_SOURCES} not found (not a Debian system?)")
    text = DEBIAN_SOURCES.read_text()
    for stanza in re.split(r"\n\s*\n", text):
        uris = re.findall(r"^URIs:\s*(.+)$", stanza, flags=re.M)
        if not uris:
            continue
        for uri in uris[0].split():
            if not uri.rstrip("/").endswith("-security"):
                return uri
    raise HeaderFetchError(f"no Debian archive URI found in {DEBIAN_SOURCES}")


def _fetch_debian_headers(dest: Path) -> Path:
    """Download libonnxruntime-dev from Debian trixie, verify, unpack; return its include dir."""
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise HeaderFetchError(f"'{tool}' is not available")
    uri = _debian_mirror_uri()
    with tempfile.TemporaryDirectory(prefix="onnxfuse-ort-") as tmp:
        tmpd = Path(tmp)
        parts = tmpd / "sources.list.d"
        lists = tmpd / "lists"
        cache = tmpd / "cache"
        dl = tmpd / "download"
        for d in (parts, lists / "partial", cache / "archives" / "partial", dl):
            d.mkdir(parents=True)
        signed = f"Signed-By: {DEBIAN_KEYRING}\n" if DEBIAN_KEYRING.is_file() else ""
        (parts / "onnxfuse-trixie.sources").write_text(
            f"Types: deb\nURIs: {uri}\nSuites: {ORT_DEB_SUITE}\nComponents: main\n{signed}"
        )
        opts = [
            "-o", f"Dir::State::Lists={lists}",
            "-o", "Dir::Etc::SourceList=/dev/null",
            "-o", f"Dir::Etc::SourceParts={parts}",
            "-o", f"Dir::Cache={cache}",
            "-o", "Debug::NoLocking=1",
            "-q",
        ]
        if os.geteuid() == 0:  # apt would drop to _apt, which cannot write our private folders
            opts[-1:-1] = ["-o", "APT::Sandbox::User=root"]
        _log(f"fetching {ORT_DEB_PACKAGE} ({ORT_DEB_SUITE}) with apt-get from {uri}")
        for args, cwd in ((["update"], None), (["download", ORT_DEB_PACKAGE], dl)):
            try:
                r = subprocess.run(["apt-get", *opts, *args], cwd=cwd, capture_output=True,
                                   text=True, timeout=300)
            except (OSError, subprocess.TimeoutExpired) as e:
                raise HeaderFetchError(f"apt-get {args[0]} failed: {e}") from e
            if r.returncode != 0:
                raise HeaderFetchError(
                    f"apt-get {' '.join(args)} failed (exit {r.returncode}):\n"
                    f"{(r.stdout + r.stderr).strip()[-2000:]}"
                )
        debs = sorted(dl.glob(f"{ORT_DEB_PACKAGE}_*.deb"))
        if not debs:
            raise HeaderFetchError(f"apt-get download produced no {ORT_DEB_PACKAGE} .deb")
        deb = debs[0]
        digest = hashlib.sha256(deb.read_bytes()).hexdigest()
        if digest != ORT_DEB_SHA256:
            raise HeaderFetchError(
                f"{deb.name}: sha256 {digest} does not match the pinned {ORT_DEB_SHA256} "
                f"(expected {ORT_DEB_PACKAGE} {ORT_DEB_VERSION_PREFIX}.x)"
            )
        root = tmpd / "root"
        r = subprocess.run(["dpkg", "-x", str(deb), str(root)], capture_output=True, text=True)
        if r.returncode != 0:
            raise HeaderFetchError(f"dpkg -x {deb.name} failed: {r.stderr.strip()}")
        found = [p.parent for p in root.rglob("onnxruntime_cxx_api.h")]
        if not found:
            raise HeaderFetchError(f"{deb.name} holds no onnxruntime_cxx_api.h")
        staging = dest.with_name(dest.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        shutil.copytree(found[0], staging)
        (staging / "SOURCE").write_text(f"{deb.name} sha256 {digest}\n")
        shutil.rmtree(dest, ignore_errors=True)
        staging.rename(dest)
    _log(f"ONNX Runtime headers cached in {dest}")
    return dest


def find_ort_include_dir() -> Path:
    env = os.environ.get("ONNXRUNTIME_INCLUDE_DIR")
    if env:
        inc = _normalize_include_dir(Path(env))
        if inc is None:
            raise HeaderFetchError(
                f"ONNXRUNTIME_INCLUDE_DIR={env} holds no onnxruntime_cxx_api.h. {HOW_TO_FIX}"
            )
        return inc
    cached = _cache_root() / f"ort-headers-{ORT_DEB_SHA256[:12]}"
    if (cached / "onnxruntime_cxx_api.h").is_file():
        return cached
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        return _fetch_debian_headers(cached)
    except (HeaderFetchError, OSError) as e:
        raise HeaderFetchError(
            "could not obtain ONNX Runtime's C/C++ API headers (needed to build the "
            f"FusedElementwise custom-op library): {e}\n{HOW_TO_FIX}"
        ) from e


def embed_header(src: Path, dst: Path) -> None:
    """Write ``src`` as a C++ raw string literal so NVRTC sources can include the same op maths."""
    text = src.read_text()
    delim = "ONNXFUSE_EMBED"
    assert f"){delim}\"" not in text
    chunks = [text[i:i + 8000] for i in range(0, len(text), 8000)]  # MSVC-safe literal sizes
    body = "\n".join(f'R"{delim}({c}){delim}"' for c in chunks)
    out = (f"// Generated from {src.name} by setup.py; do not edit.\n"
           f"static const char kOpsHeaderSource[] =\n{body};\n")
    if not dst.exists() or dst.read_text() != out:
        dst.write_text(out)


class BuildExt(build_ext):
    def build_extensions(self):
        try:
            inc = find_ort_include_dir()
        except HeaderFetchError as e:
            raise SystemExit(f"error: {e}") from None
        _log(f"using ONNX Runtime headers from {inc}")
        gen = Path(self.build_temp) / "onnxfuse_gen"
        gen.mkdir(parents=True, exist_ok=True)
        embed_header(CSRC / "ops.h", gen / "ops_h.inc")
        # Pure C++: drop Python's own (C) compile flags where we can.
        for attr in ("compiler", "compiler_so", "compiler_cxx", "linker_so"):
            cmd = getattr(self.compiler, attr, None)
            if isinstance(cmd, list) and cmd:
                cmd = [c for c in cmd if c not in ("-Wstrict-prototypes", "-g", "-O2", "-DNDEBUG")]
                cxx = os.environ.get("CXX", "g++")
                cmd[0] = cxx if attr != "linker_so" or cmd[0] in ("gcc", "cc") else cmd[0]
                if attr == "linker_so":
                    cmd[0] = cxx
                self.compiler.set_executable(attr, cmd)
        for ext in self.extensions:
            ext.include_dirs = [str(inc), str(gen), str(CSRC)] + list(ext.include_dirs)
        super().build_extensions()

    def get_ext_filename(self, ext_name):
        # A plain shared library (no Python init): no ABI tag, so one build serves every Python.
        if ext_name.endswith("_fused_ops"):
            return os.path.join(*ext_name.split(".")) + ".so"
        return super().get_ext_filename(ext_name)

    def get_export_symbols(self, ext):
        return []  # there is no PyInit_ function to export


fused_ops = Extension(
    "onnxfuse.custom_ops._fused_ops",
    sources=[str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.cc"))],
    depends=[str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.h"))] + ["onnxfuse/custom_ops/csrc/exports.map"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffunction-sections",
                        "-fdata-sections", "-Wall",
                        "-Wno-unused-function"],
    # Static libstdc++ with every symbol but ours kept private (version script): the library then
    # loads next to any other libstdc++ in the process (numpy, ONNX Runtime) without mixing state,
    # and needs no GLIBCXX of the machine it runs on. libgcc_s stays dynamic (present everywhere).
    extra_link_args=["-static-libstdc++", f"-Wl,--version-script={CSRC / 'exports.map'}",
                     "-Wl,--gc-sections", "-Wl,-Bsymbolic", "-ldl", "-Wl,--as-needed"],
)

setup(ext_modules=[fused_ops], cmdclass={"build_ext": BuildExt})
