"""The one report of every benchmark routine: tables as rich renders them on the terminal
(and into .txt files), the same tables as markdown for docs/, the number formats, and the
JSON records (``--json``; docs/compare/*.json).

A routine builds :class:`Table` objects (strings in cells) and hands them to
:func:`print_tables`, :func:`to_text` or :func:`to_markdown`. Only the rich renderers
import rich (the ``bench`` extra); markdown needs nothing.
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from typing import Optional, Sequence

__all__ = ["Table", "print_tables", "to_text", "to_markdown", "console", "fmt_us", "fmt_ms", "fmt_ratio",
           "fmt_ctx", "fmt_num", "dumps_record", "dump_record"]


@dataclass
class Table:
    """One table. ``align``: one character per column, "l" or "r" (default: the first
    column and a column named "note" left, the others right)."""

    title: str
    header: list
    rows: list = field(default_factory=list)
    caption: Optional[str] = None
    align: Optional[str] = None

    def alignment(self) -> str:
        if self.align:
            return self.align
        return "".join("l" if i == 0 or h == "note" else "r" for i, h in enumerate(self.header))


def console(width: Optional[int] = None, **kw):
    """A rich Console at least ``width`` columns wide (the terminal's width otherwise)."""
    from rich.console import Console

    if width is not None:
        kw["width"] = max(Console().width, width) if "file" not in kw else width
    return Console(**kw)


def _rich_table(t: Table):
    from rich.table import Table as RichTable

    rt = RichTable(title=t.title, caption=t.caption, title_justify="left", caption_justify="left")
    for h, a in zip(t.header, t.alignment()):
        rt.add_column(str(h), justify="left" if a == "l" else "right")
    for r in t.rows:
        rt.add_row(*(str(c) for c in r))
    return rt


def print_tables(tables: Sequence[Table], con=None, lines: Sequence[str] = ()) -> None:
    """Prints ``lines`` (plain, one each), then the tables, on ``con`` (a new Console of
    the terminal's width by default)."""
    con = con or console()
    for line in lines:
        con.print(line, highlight=False, soft_wrap=True)
    for t in tables:
        con.print(_rich_table(t))


def to_text(tables: Sequence[Table], width: int = 200, lines: Sequence[str] = (), notes: Sequence[str] = ()) -> str:
    """The tables as plain text (no colour) ``width`` columns wide: ``lines`` first, then
    the tables, then ``notes`` as "- " items."""
    con = console(width, file=io.StringIO(), no_color=True, record=True)
    print_tables(tables, con, lines)
    for n in notes:
        con.print(f"- {n}", highlight=False, soft_wrap=True)
    return con.export_text()


def to_markdown(tables: Sequence[Table], heading: str = "bold", preamble: Sequence[str] = (),
                notes: Sequence[str] = ()) -> str:
    """The tables as markdown: each title as ``**title**`` (``heading="bold"``) or a
    ``#### title`` heading (``heading="h4"``), the table, its caption; ``preamble``
    paragraphs first, ``notes`` as a list last. A "|" inside a cell becomes "/"."""
    parts = [f"{p}\n" for p in preamble]
    for t in tables:
        parts.append(f"#### {t.title}\n" if heading == "h4" else f"**{t.title}**\n")
        parts.append("| " + " | ".join(str(h) for h in t.header) + " |")
        parts.append("|" + "|".join("---" if a == "l" else "---:" for a in t.alignment()) + "|")
        parts += ["| " + " | ".join(str(c).replace("|", "/") for c in r) + " |" for r in t.rows]
        if t.caption:
            parts.append(f"\n{t.caption}")
        parts.append("")
    parts += [f"- {n}" for n in notes]
    return "\n".join(parts) + ("\n" if notes else "")


# --------------------------------------------------------------------------------------
# number formats
# --------------------------------------------------------------------------------------


def fmt_us(x: Optional[float]) -> str:
    """Microseconds: no decimals from 100 up, one below; "-" when missing."""
    if x is None:
        return "-"
    return f"{x:.0f}" if x >= 100 else f"{x:.1f}"


def fmt_ms(us: Optional[float]) -> str:
    """Microseconds shown as milliseconds, two decimals; "-" when missing."""
    return "-" if us is None else f"{us / 1e3:.2f}"


def fmt_ratio(x: Optional[float]) -> str:
    """A ratio: one decimal from 1 up, two significant digits below (a ratio of 0.0071 must
    not read "0.0x"); "-" when missing."""
    if x is None:
        return "-"
    return f"{x:.1f}x" if x >= 1 else f"{x:.2g}x"


def fmt_ctx(ctx: Optional[int]) -> str:
    """A context length: 4096 -> "4K", 1 << 20 -> "1M"; None -> "any ctx"."""
    if ctx is None:
        return "any ctx"
    if ctx % (1 << 20) == 0:
        return f"{ctx >> 20}M"
    return f"{ctx // 1024}K" if ctx % 1024 == 0 else str(ctx)


def fmt_num(x: Optional[float], spec: str = ".1f", suffix: str = "") -> str:
    """``format(x, spec) + suffix``, "-" when missing."""
    return "-" if x is None else format(x, spec) + suffix


def dumps_record(record: dict) -> str:
    """A routine's JSON record as text: one top-level key per line, and a list of row dicts
    (``rows``) one row per line, so that a record diffs per case and stays small in the
    tree (every device call carries the tree: tests/test_serve_smoke.py's budget)."""
    import json

    lines = []
    for i, (k, v) in enumerate(record.items()):
        end = "," if i < len(record) - 1 else ""
        if isinstance(v, list) and v and all(isinstance(r, dict) for r in v):
            rows = [json.dumps(r) for r in v]
            lines.append(f" {json.dumps(k)}: [\n  " + ",\n  ".join(rows) + f"\n ]{end}")
        else:
            lines.append(f" {json.dumps(k)}: {json.dumps(v)}{end}")
    return "{\n" + "\n".join(lines) + "\n}\n"


def dump_record(record: dict, path: str) -> None:
    """:func:`dumps_record` into ``path``."""
    with open(path, "w") as f:
        f.write(dumps_record(record))
