#!/usr/bin/env python3
"""Write ONNX Runtime's fusion test models into a folder: the corpus ``tools/ort_corpus_check.py`` runs.

Why: ORT's own fusion tests are the widest set of small graphs written the way ORT's tools and its
test authors write them (unsorted nodes, LayerNormalization below opset 17, contrib ops in odd domains,
IR 3 models). If ONNX Runtime runs one, onnxfuse must accept it (issue 29). The models are test data:
they are never committed here.

Source: a git directory or a checkout of microsoft/onnxruntime, or of a fork carrying the same
``onnxruntime/test/`` tree (onnxruntime/onnxruntime-qnn is much smaller to fetch). Three parts:

* ``fusion/``: ``onnxruntime/test/testdata/transform/fusion/*.onnx``
* ``transformers/``: ``onnxruntime/test/python/transformers/test_data/models/**/*.onnx``
* ``generated/``: what ``bert_model_generator.py``, ``gpt2_model_generator.py`` and
  ``conformer_model_generator.py`` (``onnxruntime/test/python/transformers/``) write when run as scripts
  (they need onnx, numpy and packaging; they save to paths relative to their working directory).

    python tools/fetch_ort_corpus.py /work/.mirror/onnxruntime+onnxruntime-qnn/repo /tmp/ort-corpus
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FUSION = "onnxruntime/test/testdata/transform/fusion"
TRANSFORMERS = "onnxruntime/test/python/transformers"
GENERATORS = ("bert_model_generator.py", "gpt2_model_generator.py", "conformer_model_generator.py")


class Source:
    """Files of ``path``: a bare git directory (read at ``rev``) or a working tree."""

    def __init__(self, path: Path, rev: str):
        self.path, self.rev = path, rev
        self.git = (path / "HEAD").is_file() and (path / "objects").is_dir()

    def list(self, folder: str, recursive: bool = False) -> list[str]:
        if self.git:
            args = ["ls-tree", "--name-only"] + (["-r"] if recursive else []) + [self.rev, folder + "/"]
            out = subprocess.run(["git", "--git-dir", str(self.path), *args], check=True, capture_output=True, text=True)
            return [line for line in out.stdout.splitlines() if line]
        base = self.path / folder
        files = base.rglob("*") if recursive else base.glob("*")
        return [str(f.relative_to(self.path)) for f in sorted(files) if f.is_file()]

    def read(self, name: str) -> bytes | None:
        """The file's bytes; None when a partial mirror lists it without holding its blob."""
        if self.git:
            done = subprocess.run(["git", "--git-dir", str(self.path), "show", f"{self.rev}:{name}"],
                                  capture_output=True)
            return done.stdout if done.returncode == 0 else None
        return (self.path / name).read_bytes()


def copy_models(src: Source, folder: str, out: Path, recursive: bool) -> int:
    n = 0
    for name in src.list(folder, recursive):
        if not name.endswith(".onnx"):
            continue
        data = src.read(name)
        if data is None:
            print(f"warning: {name}: listed but not in the source (a partial mirror), skipped", file=sys.stderr)
            continue
        target = out / Path(name).relative_to(folder)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        n += 1
    return n


def run_generators(src: Source, out: Path) -> int:
    """Run each generator as a script in a scratch folder and keep every ``.onnx`` it wrote."""
    out.mkdir(parents=True, exist_ok=True)
    n = 0
    with tempfile.TemporaryDirectory(prefix="ort-generators-") as tmp:
        work = Path(tmp)
        for script in GENERATORS:
            data = src.read(f"{TRANSFORMERS}/{script}")
            if data is None:
                raise SystemExit(f"{TRANSFORMERS}/{script}: not in the source")
            (work / script).write_bytes(data)
        (work / "test_data" / "models" / "conformer").mkdir(parents=True)
        for script in GENERATORS:
            done = subprocess.run([sys.executable, script], cwd=work, capture_output=True, text=True)
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["?"])[-1]
                print(f"warning: {script} failed: {tail}", file=sys.stderr)
        for f in sorted(work.rglob("*.onnx")):
            shutil.copyfile(f, out / f.name)
            n += 1
    return n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("source", type=Path, help="onnxruntime git directory (bare) or checkout")
    ap.add_argument("out", type=Path, help="folder to write the models to (fusion/, transformers/, generated/)")
    ap.add_argument("--rev", default="HEAD", help="revision to read from a git directory (default HEAD)")
    args = ap.parse_args(argv)
    src = Source(args.source, args.rev)
    counts = {
        "fusion": copy_models(src, FUSION, args.out / "fusion", recursive=False),
        "transformers": copy_models(src, f"{TRANSFORMERS}/test_data/models", args.out / "transformers", recursive=True),
        "generated": run_generators(src, args.out / "generated"),
    }
    print(", ".join(f"{k}: {v}" for k, v in counts.items()), f"models written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
