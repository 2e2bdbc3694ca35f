"""Build onnxfuse's FusedElementwise custom-op library for ONNX Runtime.

The C++ library (onnxfuse/custom_ops/csrc) is compiled as a setuptools Extension named
``onnxfuse.custom_ops._fused_ops``. It is a plain shared library that ONNX Runtime loads by path
(``SessionOptions.register_custom_ops_library``); Python never imports it.

The build needs a C++17 compiler and nothing else:

* ONNX Runtime's API comes from ``csrc/ort_abi.h``, the library's own declaration of the C API
  entries it calls at their fixed positions (written by ``tools/gen_ort_abi.py`` from a real
  ``onnxruntime_c_api.h``, proved against real headers by ``tests/test_ort_abi.py``). No ONNX
  Runtime headers, no package manager, no download.
* No CUDA headers: the library declares the few CUDA driver API and NVRTC entry points it uses and
  dlopens ``libcuda.so.1`` / libnvrtc at run time, only when a CUDA kernel is created.

The library links no Python (no ``PyInit_``), so the wheel is tagged ``py3-none-<platform>``: one
wheel serves every Python 3. The platform tag is ``manylinux_2_<N>_<arch>``, where N is the newest
glibc symbol version the built library asks for (read from its ELF ``.gnu.version_r`` section) and
arch comes from the library's ELF header, so a cross build is tagged for its target. libstdc++ is
linked statically with its symbols kept private; libgcc_s, libc, libm and libdl are the only
shared libraries it needs (all in every manylinux policy).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import struct
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

try:  # setuptools >= 70.1 carries bdist_wheel itself
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # pragma: no cover - older setuptools with the wheel package
    from wheel.bdist_wheel import bdist_wheel

ROOT = Path(__file__).resolve().parent
CSRC = ROOT / "onnxfuse" / "custom_ops" / "csrc"
LIBRARY = "onnxfuse.custom_ops._fused_ops"

# ELF e_machine -> the architecture name in wheel platform tags.
ELF_MACHINES = {62: "x86_64", 183: "aarch64", 3: "i686", 21: "ppc64le", 22: "s390x", 243: "riscv64"}


def _log(msg: str) -> None:
    print(f"onnxfuse build: {msg}", file=sys.stderr, flush=True)


def compiler_command() -> list[str]:
    """The C++ compiler to use (``$CXX``, else g++, else c++/clang++); exits with one line if none."""
    env = os.environ.get("CXX")
    candidates = [shlex.split(env)] if env else [["g++"], ["c++"], ["clang++"]]
    for cmd in candidates:
        if cmd and shutil.which(cmd[0]):
            return cmd
    wanted = f"CXX={env!r} was not found" if env else "no C++ compiler (g++, c++ or clang++) on PATH"
    raise SystemExit(
        f"error: building onnxfuse from source needs a C++17 compiler: {wanted}. Install one "
        "(Debian/Ubuntu: apt install g++; RHEL/Fedora: dnf install gcc-c++; conda: conda install "
        "gxx_linux-64) or install a prebuilt onnxfuse wheel."
    )


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


def elf_platform(path: Path) -> tuple[str, tuple[int, int]]:
    """(architecture, newest GLIBC_x.y version needed) of a 64-bit little-endian ELF shared library.

    Walks the section headers to ``.gnu.version_r`` (SHT_GNU_verneed) and reads each needed
    version's name from the string table it links to, as ``readelf -V`` would.
    """
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise RuntimeError(f"{path}: not a 64-bit little-endian ELF file")
    machine = struct.unpack_from("<H", data, 18)[0]
    arch = ELF_MACHINES.get(machine)
    if arch is None:
        raise RuntimeError(f"{path}: unknown ELF machine {machine}")
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    newest = (2, 17)  # the oldest glibc a manylinux tag names
    for _name, sh_type, _flags, _addr, offset, _size, link, info, _align, _entsize in sections:
        if sh_type != 0x6FFFFFFE:  # SHT_GNU_verneed
            continue
        strtab = sections[link][4]
        pos = offset
        for _ in range(info):  # sh_info: number of Verneed entries
            _ver, cnt, _file, aux, nxt = struct.unpack_from("<HHIII", data, pos)
            apos = pos + aux
            for _ in range(cnt):
                _hash, _flags2, _other, name_off, anext = struct.unpack_from("<IHHII", data, apos)
                end = data.index(b"\0", strtab + name_off)
                name = data[strtab + name_off:end].decode()
                if name.startswith("GLIBC_") and name[6:].replace(".", "").isdigit():
                    parts = tuple(int(p) for p in name[6:].split("."))[:2]
                    newest = max(newest, (parts + (0,))[:2])
                apos += anext
            pos += nxt
    return arch, newest


class BuildExt(build_ext):
    def build_extensions(self):
        cxx = compiler_command()
        # Objects of another compiler (a cross build, say) must not be reused: one folder per compiler.
        self.build_temp = os.path.join(self.build_temp, re.sub(r"[^A-Za-z0-9_.+-]", "_", "_".join(cxx)))
        gen = Path(self.build_temp) / "onnxfuse_gen"
        gen.mkdir(parents=True, exist_ok=True)
        embed_header(CSRC / "ops.h", gen / "ops_h.inc")
        # Pure C++: drop Python's own (C) compile flags where we can.
        for attr in ("compiler", "compiler_so", "compiler_cxx", "linker_so"):
            cmd = getattr(self.compiler, attr, None)
            if isinstance(cmd, list) and cmd:
                cmd = [c for c in cmd if c not in ("-Wstrict-prototypes", "-g", "-O2", "-DNDEBUG")]
                cmd = cxx + cmd[1:]
                self.compiler.set_executable(attr, cmd)
        for ext in self.extensions:
            ext.include_dirs = [str(gen), str(CSRC)] + list(ext.include_dirs)
        _log(f"compiling the custom-op library with {' '.join(cxx)}")
        super().build_extensions()

    def get_ext_filename(self, ext_name):
        # A plain shared library (no Python init): no ABI tag, so one build serves every Python.
        if ext_name.endswith("_fused_ops"):
            return os.path.join(*ext_name.split(".")) + ".so"
        return super().get_ext_filename(ext_name)

    def get_export_symbols(self, ext):
        return []  # there is no PyInit_ function to export


class BdistWheel(bdist_wheel):
    """Tag the wheel ``py3-none-manylinux_2_N_<arch>`` from the library it carries."""

    def finalize_options(self):
        super().finalize_options()
        self.root_is_pure = False

    def get_tag(self):
        build = self.get_finalized_command("build_ext")
        lib = Path(build.get_ext_fullpath(LIBRARY))
        if not lib.is_file():  # not built yet (tag asked early): fall back to the default
            return super().get_tag()
        arch, (major, minor) = elf_platform(lib)
        return "py3", "none", f"manylinux_{major}_{minor}_{arch}"


fused_ops = Extension(
    LIBRARY,
    sources=[str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.cc"))],
    depends=[str(p.relative_to(ROOT)) for p in sorted(CSRC.glob("*.h"))] + ["onnxfuse/custom_ops/csrc/exports.map"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17", "-fPIC", "-fvisibility=hidden", "-ffunction-sections",
                        "-fdata-sections", "-Wall",
                        "-Wno-unused-function"],
    # Static libstdc++ with every symbol but ours kept private (version script): the library then
    # loads next to any other libstdc++ in the process (numpy, ONNX Runtime) without mixing state,
    # and needs no GLIBCXX of the machine it runs on. libgcc_s stays dynamic (present everywhere).
    extra_link_args=["-static-libstdc++", "-s", f"-Wl,--version-script={CSRC / 'exports.map'}",
                     "-Wl,--gc-sections", "-Wl,-Bsymbolic", "-ldl", "-Wl,--as-needed"],
)

setup(ext_modules=[fused_ops], cmdclass={"build_ext": BuildExt, "bdist_wheel": BdistWheel})
