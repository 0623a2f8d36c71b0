"""Rewrite the README's configuration reference from the settings classes.

uv run python scripts/settings_reference.py
"""

from __future__ import annotations

from pathlib import Path

from conveyor_runtime.settings import reference_markdown

README = Path(__file__).resolve().parent.parent / "README.md"
START, END = "<!-- settings-reference:start -->\n", "<!-- settings-reference:end -->"


def main() -> None:
    text = README.read_text()
    head, _, rest = text.partition(START)
    _, _, tail = rest.partition(END)
    README.write_text(head + START + reference_markdown() + END + tail)
    print("README configuration reference updated")


if __name__ == "__main__":
    main()
