"""Regenerate docs/developing.md's profile table (``tests/test_contract.py`` checks it).

Run: ``.venv/bin/python scripts/profile_table.py``.
"""

from __future__ import annotations

from pathlib import Path

from veloxquant_mlx.cache.profile import capability_table
from veloxquant_mlx.registry import methods

DOC = Path(__file__).resolve().parent.parent / "docs" / "developing.md"
START, END = "<!-- profile table: start -->", "<!-- profile table: end -->"


def main() -> None:
    text = DOC.read_text(encoding="utf-8")
    head, rest = text.split(START, 1)
    tail = rest.split(END, 1)[1]
    DOC.write_text(f"{head}{START}\n{capability_table(methods())}\n{END}{tail}",
                   encoding="utf-8")


if __name__ == "__main__":
    main()
