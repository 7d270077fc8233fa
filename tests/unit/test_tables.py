"""The one table renderer: aligned text columns and Markdown."""

from __future__ import annotations

import pytest

from asteria_client.tables import markdown_table, text_table


def test_text_columns_are_aligned_name_left_numbers_right() -> None:
    lines = text_table([["BLOCK", "VERSION"], ["w.L", "12"], ["longer.R", "3"]])
    assert lines == ["BLOCK     VERSION", "w.L            12", "longer.R        3"]


def test_text_alignment_per_column_the_last_repeats_and_short_rows_leave_cells_empty() -> None:
    lines = text_table([["a", "bb", "c"], ["10", "2"]], align=">", gap=1)
    assert lines == [" a bb c", "10  2"]
    assert text_table([["x", "y"], ["long", "z"]], align="<<") == ["x     y", "long  z"]
    assert text_table([]) == []


def test_markdown_header_alignment_and_escaped_bars() -> None:
    lines = markdown_table(["run", "ms"], [["a|b", "1.0"]], align="<>")
    assert lines == ["| run | ms |", "|---|---:|", "| a\\|b | 1.0 |"]
    assert markdown_table(["a", "b"], [], align="<")[1] == "|---|---|"


def test_bad_alignment_and_ragged_markdown_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="align"):
        text_table([["a"]], align="^")
    with pytest.raises(ValueError, match="2 cells under a header of 1"):
        markdown_table(["a"], [["1", "2"]])
