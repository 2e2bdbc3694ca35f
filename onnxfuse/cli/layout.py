"""Terminal layout that survives a CI log: tables that never cut an identifier or drop a column, and
prose that never breaks inside a flag.

Why: without a TTY, rich renders at 80 columns and shrinks every column to fit, so at 80 columns
`onnxfuse rules` printed ``fold-batchnorm-convtra…`` (a name users must pass to ``--skip``) and a
bench table squeezed its last column to nothing. Here each column says what it holds:

* ``"id"``: identifiers (rule names, op types, output names): never wrapped, never cut;
* ``"num"``: numbers and short values: right-justified, never wrapped, never cut;
* ``"text"``: prose: wraps, but keeps at least :data:`TEXT_MIN_WIDTH` cells (long words fold).
* ``"path"``: slash-separated names (ONNX node names, ``/layers.0/attn/Reshape_10``): as wide as prose,
  but wrapped only before a ``/``, so each part of the name stays whole (one longer than the
  column folds).

:class:`FitTable` measures those minimums when it is printed (so it fits whichever console prints
it) and, when the columns cannot all fit side by side, prints the table in parts, each repeating the
first column, titled "(continued)". Nothing is ever replaced by an ellipsis: at absurd widths a
cell folds onto the next line instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rich.table import Table
from rich.text import Text

#: The narrowest a wrapping column gets before the table is split instead.
TEXT_MIN_WIDTH = 20
#: Cells a column costs besides its content: one space of padding each side and one border.
_COLUMN_OVERHEAD = 3
KINDS = ("id", "num", "text", "path")


@dataclass(frozen=True)
class Column:
    header: str
    kind: str = "text"

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"column kind {self.kind!r} is not one of {KINDS}")


def _table_width(column_widths: list[int]) -> int:
    """A table's width in cells for these column contents: padding and borders included."""
    return sum(w + _COLUMN_OVERHEAD for w in column_widths) + 1


def _cell_width(cell: str) -> int:
    """Widest line of a cell written in rich markup, in terminal cells."""
    return max((Text.from_markup(line).cell_len for line in cell.split("\n")), default=0)


class FitTable:
    """A table whose columns declare their kind (see the module docstring); add rows, then print it
    with any rich console. Cells are rich markup strings."""

    def __init__(self, title: str | None, columns: list[Column], caption: str | None = None):
        if not columns:
            raise ValueError("a table needs at least one column")
        self.title = title
        self.columns = list(columns)
        self.caption = caption
        self.rows: list[tuple[list[str], str | None]] = []

    def add_row(self, *cells, style: str | None = None) -> None:
        if len(cells) != len(self.columns):
            raise ValueError(f"row has {len(cells)} cells for {len(self.columns)} columns")
        self.rows.append(([str(c) for c in cells], style))

    def min_widths(self) -> list[int]:
        """The width each column needs: identifiers and numbers whole, prose at least TEXT_MIN_WIDTH
        (or its whole content, when shorter)."""
        widths = []
        for i, col in enumerate(self.columns):
            cells = [row[i] for row, _ in self.rows]
            content = max([_cell_width(col.header)] + [_cell_width(c) for c in cells])
            if col.kind in ("text", "path"):
                # Prose wraps at spaces, paths before a '/'; a longer word folds (nothing is cut).
                content = min(content, TEXT_MIN_WIDTH)
            widths.append(content)
        return widths

    def parts(self, width: int, mins: list[int] | None = None) -> list[list[int]]:
        """Column indices of each printed part: all columns when they fit in ``width``, else groups
        that each start with column 0 and take the next columns while they fit."""
        mins = self.min_widths() if mins is None else mins
        groups, group = [], [0]
        for i in range(1, len(self.columns)):
            if len(group) > 1 and _table_width([mins[j] for j in group + [i]]) > width:
                groups.append(group)
                group = [0]
            group.append(i)
        groups.append(group)
        return groups

    def tables(self, width: int) -> list[Table]:
        mins = self.min_widths()  # measured once: every cell's markup is parsed for it
        groups = self.parts(width, mins)
        out = []
        for k, group in enumerate(groups):
            title = self.title if k == 0 or self.title is None else f"{self.title} (continued)"
            # min_width: the title on one line where the console allows it.
            table = Table(title=title, title_justify="left", min_width=min(len(title or ""), width),
                          caption=self.caption if k == len(groups) - 1 else None, caption_justify="left")
            widths = self._fit_prose(group, mins, width)
            for i in group:
                col = self.columns[i]
                table.add_column(col.header, justify="right" if col.kind == "num" else "left",
                                 no_wrap=col.kind != "text", min_width=widths[i], overflow="fold")
            for cells, style in self.rows:
                table.add_row(*(wrap_path(cells[i], widths[i]) if self.columns[i].kind == "path" else cells[i]
                                for i in group), style=style)
            out.append(table)
        return out

    def _fit_prose(self, group: list[int], mins: list[int], width: int) -> dict[int, int]:
        """Minimum widths for one part. On a console too narrow even for one column beside the first,
        prose columns give up their 20 cells (down to 4) so they wrap instead of being cropped."""
        widths = {i: mins[i] for i in group}
        prose = [i for i in group if self.columns[i].kind in ("text", "path")]
        if not prose:
            return widths
        room = width - _table_width([0 if i in prose else mins[i] for i in group])
        if sum(mins[i] for i in prose) > room:
            for i in prose:
                widths[i] = max(4, min(mins[i], room // len(prose)))
        return widths

    def __rich_console__(self, console, options):
        yield from self.tables(options.max_width)


# --- prose ------------------------------------------------------------------------------------------

#: Spans that must stay on one line: `backticked` commands, and a --flag with the value after it.
_UNBREAKABLE = re.compile(r"`[^`]*`|--[\w-]+(?:[ =](?![-`])\S+)?")


def wrap_path(text: str, width: int) -> str:
    """``text`` as lines of at most ``width`` cells, broken only before a ``/`` (a part longer than a
    line is folded into pieces of ``width``)."""
    lines, line = [], ""
    for part in (p for p in re.split(r"(?=/)", text) if p):
        if line and len(line) + len(part) > width:
            lines.append(line)
            line = ""
        while len(part) > width > 0:
            if line:
                lines.append(line)
                line = ""
            lines.append(part[:width])
            part = part[width:]
        line += part
    if line:
        lines.append(line)
    return "\n".join(lines)


def wrap_prose(text: str, width: int, fold: bool = False) -> list[str]:
    """Wrap ``text`` at spaces into lines of at most ``width`` cells, never inside a `backticked`
    span or between a ``--flag`` and its value (a span longer than a line gets a line of its own).
    ``fold``: a word longer than a line (a file path in an error message) is broken as :func:`wrap_path`
    breaks it, before a ``/``, so no line is wider than ``width``."""
    protected = _UNBREAKABLE.sub(lambda m: m.group(0).replace(" ", "\x00"), text)
    lines: list[str] = []
    line = ""
    for word in protected.split():
        candidate = f"{line} {word}" if line else word
        if line and len(candidate) > width:
            lines.append(line)
            line = word
        else:
            line = candidate
    if line or not lines:
        lines.append(line)
    lines = [x.replace("\x00", " ") for x in lines]
    if fold:
        lines = [part for x in lines for part in (wrap_path(x, width).split("\n") if len(x) > width else [x])]
    return lines


def print_prose(console, text: str, prefix: str = "", prefix_markup: str | None = None, fold: bool = False) -> None:
    """Print ``prefix`` + ``text`` wrapped to ``console``'s width with :func:`wrap_prose`, later lines
    indented under the text. ``text`` is plain (never markup); ``prefix_markup`` styles the prefix;
    ``fold`` breaks words longer than a line (see :func:`wrap_prose`)."""
    indent = len(prefix)
    lines = wrap_prose(text, max(20, console.width - indent), fold=fold)
    for k, line in enumerate(lines):
        head = (prefix_markup if prefix_markup is not None else prefix) if k == 0 else " " * indent
        console.print(head, end="", markup=prefix_markup is not None and k == 0, highlight=False)
        console.print(line, markup=False, highlight=False, soft_wrap=True)


def shell_lines(words: list[str], width: int, indent: int = 2) -> list[str]:
    """A shell command (its words, already quoted) as lines of at most ``width`` cells, continued with
    `` \\`` and indented under the first, so it can still be pasted as printed; a flag stays on the line
    of its value. A word longer than a line gets a line of its own."""
    groups: list[str] = []
    for word in words:
        if groups and groups[-1].startswith("--") and " " not in groups[-1] and not word.startswith("-"):
            groups[-1] += " " + word
        else:
            groups.append(word)
    lines, line = [], " " * indent
    for group in groups:
        candidate = f"{line} {group}" if line.strip() else line + group
        if line.strip() and len(candidate) + 2 > width:
            lines.append(line + " \\")
            line = " " * (indent + 4) + group
        else:
            line = candidate
    lines.append(line)
    return lines
