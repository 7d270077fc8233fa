"""Text tables, the one way Asteria draws them: aligned columns for a terminal, or Markdown.

``asteria status``, ``asteria train``'s learning-rate sweep and every benchmark's summary and
report section render their rows here, so that every table looks alike and a change of style is
made once. Cells are strings: each caller formats its own numbers (units, precision), which is
what differs between tables; the layout is what they share.

Alignment is a string of ``<`` (left) and ``>`` (right), one character per column; the last one
applies to every further column. The default ``"<>"`` is the usual shape of a table of figures:
the first column (a name) left, the numbers right.
"""

from __future__ import annotations

from collections.abc import Sequence

#: First column left, every other right.
NAME_THEN_NUMBERS = "<>"


def _alignments(align: str, num_columns: int) -> list[str]:
    if not align or set(align) - {"<", ">"}:
        raise ValueError(f"align must be a string of '<' and '>', got {align!r}")
    return [align[min(i, len(align) - 1)] for i in range(num_columns)]


def text_table(
    rows: Sequence[Sequence[str]], *, align: str = NAME_THEN_NUMBERS, gap: int = 2
) -> list[str]:
    """``rows`` (the header first, if any) as lines of aligned columns, ``gap`` spaces apart,
    with no trailing whitespace. A row shorter than the others leaves its last cells empty."""
    if not rows:
        return []
    num_columns = max(len(row) for row in rows)
    widths = [max(len(row[i]) for row in rows if i < len(row)) for i in range(num_columns)]
    alignments = _alignments(align, num_columns)
    lines = []
    for row in rows:
        cells = [
            cell.ljust(width) if side == "<" else cell.rjust(width)
            for cell, width, side in zip(row, widths, alignments, strict=False)
        ]
        lines.append((" " * gap).join(cells).rstrip())
    return lines


def _markdown_cell(cell: str) -> str:
    return cell.replace("|", "\\|")  # a bare | would end the cell, even inside `code`


def markdown_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], *, align: str = "<"
) -> list[str]:
    """A GitHub-flavoured Markdown table: the header, the alignment row (``---`` for left,
    ``---:`` for right) and one line per row; ``|`` in a cell is escaped."""
    alignments = _alignments(align, len(header))
    lines = [
        "| " + " | ".join(_markdown_cell(cell) for cell in header) + " |",
        "|" + "".join("---|" if side == "<" else "---:|" for side in alignments),
    ]
    for row in rows:
        if len(row) != len(header):
            raise ValueError(f"a row of {len(row)} cells under a header of {len(header)}: {row}")
        lines.append("| " + " | ".join(_markdown_cell(cell) for cell in row) + " |")
    return lines
