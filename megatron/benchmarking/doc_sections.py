"""Sections of the docs that a script writes: the text between two marker comments, replaced by
what the script computed (bench/frontier_model.py, bench/beyond_int4.py, tools/code_map.py), so a
page's tables are the code's output and a test can compare them."""
from __future__ import annotations


class MissingSection(ValueError):
    """The page has no such pair of markers."""


def replace_section(text: str, begin: str, end: str, body: str) -> str:
    """`text` with what lies between the first `begin` and the first `end` after it replaced by
    `body`; the markers stay."""
    start = text.find(begin)
    stop = text.find(end, start + len(begin)) if start >= 0 else -1
    if stop < 0:
        raise MissingSection(f"no {begin} ... {end} section")
    return text[:start + len(begin)] + body + text[stop:]
