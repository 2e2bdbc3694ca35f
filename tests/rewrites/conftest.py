"""The rewrites' tests mirror ``onnxfuse/rewrites/``: ``fold/``, ``contrib/``, ``elementwise/``, ``engine/``
and ``facts/`` (``tests/test_test_layout.py`` checks it). Test modules import each other's fixtures by
basename (``from test_fuse_elementwise import assert_same``, ``from contrib_testlib import ...``), across
folders too, so this folder and each of its subfolders is on ``sys.path`` whichever test runs alone;
basenames stay unique across ``tests/`` (there is no ``__init__.py``: pytest's rootdir-relative imports)."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
for _folder in [_HERE, *sorted(p for p in _HERE.iterdir() if p.is_dir() and not p.name.startswith((".", "_")))]:
    if str(_folder) not in sys.path:
        sys.path.insert(0, str(_folder))
