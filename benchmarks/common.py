"""Pieces the benchmark commands share."""

from __future__ import annotations

from pathlib import Path


def replace_section(doc: Path, heading: str, text: str) -> None:
    """Put ``text`` in place of the section of ``doc`` that starts at ``heading`` (up to
    the next ``## `` heading), or append it when the section is not there yet."""
    content = doc.read_text()
    start = content.find(heading)
    if start < 0:
        content = content.rstrip("\n") + "\n\n" + text
    else:
        end = content.find("\n## ", start + len(heading))
        content = content[:start] + text + ("" if end < 0 else content[end + 1:])
    doc.write_text(content)
