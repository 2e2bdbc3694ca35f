#!/usr/bin/env python3
"""Record, then compare, what `onnxfuse optimize` writes for every testdata model: the output model's
bytes, the JSON report without its timing fields, stdout, stderr and the exit code.

Why: a speed change must not change a single output byte or report line (issue 35 item 8). Record on
the code before the change, record again after, compare:

    python tools/check_identical.py record /tmp/before                 # on the old code
    python tools/check_identical.py record /tmp/after                  # on the new code
    python tools/check_identical.py record /tmp/after-lazy --lazy-bytes 0   # every model held lazily
    python tools/check_identical.py compare /tmp/before /tmp/after

Each model runs in its own process, from the checkout's root (`python -m onnxfuse optimize testdata/MODEL OUT --provider cpu --no-bench
--json REPORT`, NO_COLOR, 100 columns). ``--lazy-bytes N`` runs the command line with
``onnxfuse.lazy_weights.LAZY_MODEL_BYTES`` and ``CLI_LAZY_MODEL_BYTES`` set to N, so a model of any
size takes the lazy-weights path.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

#: report keys whose values are measured durations or paths of this run, not results
TIMING_KEYS = {"timings", "seconds", "total_s", "rewrite_s", "validation_s", "duration_s", "elapsed_s", "stages"}
WRAPPER = """
import sys
import onnxfuse.lazy_weights as lw
n = int(sys.argv.pop(1))
lw.LAZY_MODEL_BYTES = n
lw.CLI_LAZY_MODEL_BYTES = n
from onnxfuse.cli import main
sys.argv[0] = "onnxfuse"
main()
"""
#: durations printed in the console text ("rewrite 0.88 s", "(1.2 s)")
_SECONDS = re.compile(r"\d+(\.\d+)? ?(s|ms)\b")
#: a stage line on stderr ("[   1.2s] validating"): printed only for stages that last long enough
_STAGE = re.compile(r"^\[\s*(<t>|[\d.]+ ?s)\] .*$", re.M)


def _text(text: str) -> str:
    """Console text without what depends on time: durations, stage lines, and where lines wrap (a
    duration's digits move the wrap)."""
    text = _STAGE.sub("", _SECONDS.sub("<t>", text))
    return _SECONDS.sub("<t>", re.sub(r"\s+", " ", text)).strip()


def _strip(obj):
    if isinstance(obj, dict):
        return {k: _strip(v) for k, v in obj.items() if k not in TIMING_KEYS and not k.endswith("_seconds")}
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def record(folder: Path, models: list[Path], lazy_bytes: int | None) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, NO_COLOR="1", COLUMNS="100", TERM="dumb")
    summary = {}
    for m in models:
        out, rep = folder / f"{m.stem}.out.onnx", folder / f"{m.stem}.json"
        for f in (out, rep, Path(str(out) + ".data")):
            f.unlink(missing_ok=True)
        head = [sys.executable, "-c", WRAPPER, str(lazy_bytes)] if lazy_bytes is not None else [
            sys.executable, "-m", "onnxfuse"]
        rel = m.relative_to(ROOT) if m.is_relative_to(ROOT) else m  # the same text in every checkout's report
        cmd = head + ["optimize", str(rel), str(out), "--provider", "cpu", "--no-bench", "--json", str(rep)]
        p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        entry = {"rc": p.returncode,
                 "stdout": _text(p.stdout.replace(str(folder), "<dir>")),
                 "stderr": _text(p.stderr.replace(str(folder), "<dir>"))}
        for f in (out, Path(str(out) + ".data")):
            if f.exists():
                entry[f.name.replace(m.stem, "<m>")] = hashlib.sha256(f.read_bytes()).hexdigest()
        if rep.exists():
            text = rep.read_text().replace(str(folder), "<dir>")
            entry["report"] = _strip(json.loads(text))
        summary[m.name] = entry
        print(f"{m.name}: rc {p.returncode}", flush=True)
    (folder / "summary.json").write_text(json.dumps(summary, indent=1, sort_keys=True))


def compare(a: Path, b: Path) -> int:
    sa = json.loads((a / "summary.json").read_text())
    sb = json.loads((b / "summary.json").read_text())
    for entry in list(sa.values()) + list(sb.values()):
        entry["stdout"], entry["stderr"] = _text(entry["stdout"]), _text(entry["stderr"])
    bad = 0
    for name in sorted(set(sa) | set(sb)):
        if sa.get(name) != sb.get(name):
            bad += 1
            ea, eb = sa.get(name, {}), sb.get(name, {})
            keys = sorted(k for k in set(ea) | set(eb) if ea.get(k) != eb.get(k))
            print(f"DIFFERENT {name}: {', '.join(keys)}")
    print(f"{len(set(sa) | set(sb)) - bad} identical, {bad} different")
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record")
    r.add_argument("folder", type=Path)
    r.add_argument("--models", nargs="*", type=Path, default=None, help="default: testdata/*.onnx")
    r.add_argument("--lazy-bytes", type=int, default=None)
    c = sub.add_parser("compare")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    args = ap.parse_args()
    if args.cmd == "record":
        record(args.folder.resolve(), args.models or sorted((ROOT / "testdata").glob("*.onnx")), args.lazy_bytes)
        return 0
    return compare(args.a, args.b)


if __name__ == "__main__":
    raise SystemExit(main())
