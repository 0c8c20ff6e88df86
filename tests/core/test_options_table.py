"""The README's options table names every ``ExtrapolationOptions`` field, in order, with its
default: the one place a newcomer reads them must not drift from the one place they are
declared."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

from lookahead_opd.options import ExtrapolationOptions

README = Path(__file__).resolve().parents[2] / "README.md"


def shown(value: object) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def test_the_readme_table_lists_every_option_with_its_default():
    rows = re.findall(r"^\| `(\w+)` \| `([^`]*)` \|", README.read_text(), flags=re.M)
    declared = [(f.name, shown(f.default)) for f in dataclasses.fields(ExtrapolationOptions)]
    assert rows == declared
