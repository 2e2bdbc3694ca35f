"""The on-disk CUDA kernel cache is private and verified (csrc/kernel_cache.h), checked on the CPU
with the mock CUDA driver of test_cuda_codegen.py (it records what cuModuleLoadData was given) and
NVRTC from the nvidia-cuda-nvrtc wheel:

* an entry whose binary fails its checksum, is truncated, is a symbolic link or is readable by
  others is never loaded: the kernel is compiled again and the entry rewritten;
* a symbolic link planted at the temporary file's name or at the entry's name is not followed;
* a cache folder writable by group/others, owned by another user or that is a symbolic link is
  refused with one line on stderr (once per process) and kernels are compiled in memory;
* under umask 000 the folders are still created 0700 and entries 0600.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import stat
from pathlib import Path

import pytest

from onnxfuse.custom_ops import library_path

_spec = importlib.util.spec_from_file_location("cuda_codegen_tests", Path(__file__).with_name("test_cuda_codegen.py"))
C = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(C)

mock_driver = C.mock_driver  # the module-scoped fixture (a compiled mock libcuda)
needs_nvrtc = C.needs_nvrtc
run_mock = C.run_mock

PROGRAM = "onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Relu(x)\noutput y\n"
OTHER = "onnxfuse.elementwise 1\ninput x: float32\ny: float32 = Neg(x)\noutput y\n"
LAUNCH = [([(64,)], [0x10000], [0x20000])]


def kernels_dir(home: Path) -> Path:
    return home / "onnxfuse" / "kernels"


def entry_parts(data: bytes):
    """(header lines, source, binary) of a cache entry (format in kernel_cache.cc)."""
    lines = data.split(b"\n", 4)
    assert lines[0] == b"ONNXFUSE-KERNEL 2", lines[0]
    src_len = int(lines[2].split()[1])
    _, bin_len, _, digest = lines[3].split()
    rest = lines[4]
    return lines[:4], rest[:src_len], rest[src_len:src_len + int(bin_len)], digest.decode()


def populate(mock, home: Path) -> tuple[Path, dict]:
    """Compile PROGRAM once into a fresh cache under ``home``; return its entry and the stats."""
    first = run_mock(mock, home, PROGRAM, LAUNCH)
    assert first["created"], first["error"]
    s = first["stats"]
    assert s["compiles"] == 1 and s["disk_writes"] == 1 and s["disk_refused"] == "", s
    entry = kernels_dir(home) / s["last_entry"]
    assert entry.is_file()
    return entry, first


def test_sha256_matches_hashlib():
    lib = ctypes.CDLL(library_path())
    lib.onnxfuse_test_sha256.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
    out = ctypes.create_string_buffer(65)
    data = os.urandom(200_000)
    for n in (0, 1, 3, 55, 56, 57, 63, 64, 65, 119, 120, 127, 128, 1000, 200_000):
        lib.onnxfuse_test_sha256(data[:n], n, out)
        assert out.value.decode() == hashlib.sha256(data[:n]).hexdigest(), n


@needs_nvrtc
def test_entry_format_and_modes(mock_driver, tmp_path):
    entry, first = populate(mock_driver, tmp_path)
    header, source, binary, digest = entry_parts(entry.read_bytes())
    assert hashlib.sha256(binary).hexdigest() == digest
    assert first["images"][0] == binary[:64].hex()  # what the driver loaded is what was stored
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600
    assert stat.S_IMODE(kernels_dir(tmp_path).stat().st_mode) == 0o700
    assert [p.name for p in kernels_dir(tmp_path).iterdir()] == [entry.name]  # no temporary file left
    second = run_mock(mock_driver, tmp_path, PROGRAM, LAUNCH)
    s = second["stats"]
    assert s["disk_hits"] == 1 and s["compiles"] == 0 and s["disk_rejects"] == 0
    assert second["images"][0] == binary[:64].hex()


def _planted(kind: str, binary: bytes) -> bytes:
    """A binary of the same length as the real one that must never reach the driver."""
    return (b"PLANTED-" + kind.encode() + b"-").ljust(len(binary), b"\0")


@needs_nvrtc
@pytest.mark.parametrize("damage", ["checksum", "truncated", "trailing", "source", "header"])
def test_damaged_entry_is_never_loaded(mock_driver, tmp_path, damage):
    entry, first = populate(mock_driver, tmp_path)
    data = entry.read_bytes()
    header, source, binary, digest = entry_parts(data)
    head = b"\n".join(header) + b"\n"
    planted = _planted(damage, binary)
    if damage == "checksum":  # another binary under the real binary's checksum
        data = head + source + planted
    elif damage == "truncated":  # a write cut short
        data = data[: len(data) - 100]
    elif damage == "trailing":
        data = data + b"\0"
    elif damage == "source":  # the right key and checksum, another program's source
        data = head + source.replace(b"Relu", b"Rel_") + binary
    else:  # a checksum that is not hex
        data = data.replace(digest.encode(), b"z" * 64, 1)
    entry.write_bytes(data)
    if damage == "checksum":
        planted_hex = planted[:64].hex()
    second = run_mock(mock_driver, tmp_path, PROGRAM, LAUNCH)
    assert second["created"], second["error"]
    s = second["stats"]
    assert s["disk_hits"] == 0 and s["disk_rejects"] == 1 and s["compiles"] == 1, s
    assert s["disk_writes"] == 1  # rewritten
    assert second["images"] == [first["images"][0]]  # the driver saw only the fresh compile
    if damage == "checksum":
        assert planted_hex not in second["images"] and "checksum" in s["last_disk_reject"]
    # The rewritten entry is whole again and is used by the next process.
    assert entry_parts(entry.read_bytes())[2] == binary
    third = run_mock(mock_driver, tmp_path, PROGRAM, LAUNCH)
    assert third["stats"]["disk_hits"] == 1 and third["stats"]["compiles"] == 0


@needs_nvrtc
def test_entry_readable_by_others_is_not_loaded(mock_driver, tmp_path):
    entry, first = populate(mock_driver, tmp_path)
    entry.chmod(0o644)
    second = run_mock(mock_driver, tmp_path, PROGRAM, LAUNCH)
    s = second["stats"]
    assert s["disk_rejects"] == 1 and "group or by others" in s["last_disk_reject"] and s["compiles"] == 1
    assert stat.S_IMODE(entry.stat().st_mode) == 0o600


@needs_nvrtc
def test_planted_symlinks_are_not_followed(mock_driver, tmp_path):
    """Symbolic links at the entry's name and at the temporary file's first name (``<entry>.tmp.<pid>``,
    planted by the process itself, knowing its pid) point at victim files: neither is read, written
    or truncated; the entry ends up a regular private file."""
    name = populate(mock_driver, tmp_path / "learn")[1]["stats"]["last_entry"]
    home = tmp_path / "home"
    kdir = kernels_dir(home)
    kdir.mkdir(parents=True, mode=0o700)
    kdir.chmod(0o700)
    victim_entry, victim_tmp = tmp_path / "victim-entry", tmp_path / "victim-tmp"
    victim_entry.write_bytes(b"not a kernel")
    victim_tmp.write_bytes(b"keep me")
    (kdir / name).symlink_to(victim_entry)
    pre = f"os.symlink({str(victim_tmp)!r}, os.path.join({str(kdir)!r}, {name!r} + '.tmp.' + str(os.getpid())))\n"
    r = run_mock(mock_driver, home, PROGRAM, LAUNCH, pre=pre)
    assert r["created"], r["error"]
    s = r["stats"]
    assert s["compiles"] == 1 and s["disk_rejects"] == 1 and "symbolic link" in s["last_disk_reject"], s
    assert s["disk_writes"] == 1
    assert victim_entry.read_bytes() == b"not a kernel" and victim_tmp.read_bytes() == b"keep me"
    entry = kdir / name
    assert not entry.is_symlink() and entry.is_file() and stat.S_IMODE(entry.stat().st_mode) == 0o600
    tmp_links = [p for p in kdir.iterdir() if p.is_symlink()]
    assert len(tmp_links) == 1 and tmp_links[0].name.startswith(name + ".tmp.")  # the planted one, untouched


def _refused(r, words: str, kernels: int = 2):
    assert r["created"], r["error"]  # the session does not fail: kernels are compiled in memory
    s = r["stats"]
    assert s["compiles"] == kernels and s["disk_writes"] == 0 and s["disk_hits"] == 0, s
    assert words in s["disk_refused"], s["disk_refused"]
    lines = [ln for ln in r["stderr"].splitlines() if "kernel disk cache not used" in ln]
    assert len(lines) == 1 and words in lines[0], r["stderr"]  # one line, once per process


@needs_nvrtc
@pytest.mark.parametrize("mode", [0o777, 0o770, 0o702, 0o1777])
def test_folder_writable_by_others_is_refused(mock_driver, tmp_path, mode):
    entry, first = populate(mock_driver, tmp_path)
    kernels_dir(tmp_path).chmod(mode)
    r = run_mock(mock_driver, tmp_path, [PROGRAM, OTHER], LAUNCH)
    _refused(r, "writable by its group or by others")
    assert r["more_created"] == [True]
    assert [p.name for p in kernels_dir(tmp_path).iterdir()] == [entry.name]  # nothing written


@needs_nvrtc
@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_folder_of_another_user_is_refused(mock_driver, tmp_path):
    kdir = kernels_dir(tmp_path)
    kdir.mkdir(parents=True, mode=0o700)
    os.chown(kdir, 65534, 65534)
    _refused(run_mock(mock_driver, tmp_path, [PROGRAM, OTHER], LAUNCH), "owned by uid 65534")
    assert list(kdir.iterdir()) == []


@needs_nvrtc
def test_folder_that_is_a_symlink_is_refused(mock_driver, tmp_path):
    real = tmp_path / "elsewhere"
    real.mkdir(mode=0o700)
    (tmp_path / "onnxfuse").mkdir(mode=0o700)
    kernels_dir(tmp_path).symlink_to(real)
    _refused(run_mock(mock_driver, tmp_path, PROGRAM, LAUNCH), "symbolic link", kernels=1)
    # Also as an explicit folder with a trailing slash (which would make the system follow the link).
    env = {"ONNXFUSE_KERNEL_CACHE": str(kernels_dir(tmp_path)) + "//"}
    _refused(run_mock(mock_driver, tmp_path, PROGRAM, LAUNCH, env), "symbolic link", kernels=1)
    assert list(real.iterdir()) == []


@needs_nvrtc
def test_readable_folder_of_an_older_version_is_made_private(mock_driver, tmp_path):
    """0755, as onnxfuse created it before cache version 2: nobody else could write there, so the
    folder is made 0700 and used."""
    kdir = kernels_dir(tmp_path)
    kdir.mkdir(parents=True)
    kdir.chmod(0o755)
    r = run_mock(mock_driver, tmp_path, PROGRAM, LAUNCH)
    assert r["stats"]["disk_refused"] == "" and r["stats"]["disk_writes"] == 1
    assert stat.S_IMODE(kdir.stat().st_mode) == 0o700


@needs_nvrtc
def test_umask_000_still_gives_private_files(mock_driver, tmp_path):
    home = tmp_path / "cache"
    home.mkdir()
    r = run_mock(mock_driver, home, PROGRAM, LAUNCH, pre="os.umask(0)\n")
    assert r["stats"]["disk_writes"] == 1 and r["stats"]["disk_refused"] == ""
    assert stat.S_IMODE((home / "onnxfuse").stat().st_mode) == 0o700
    assert stat.S_IMODE(kernels_dir(home).stat().st_mode) == 0o700
    entries = list(kernels_dir(home).iterdir())
    assert len(entries) == 1 and stat.S_IMODE(entries[0].stat().st_mode) == 0o600
