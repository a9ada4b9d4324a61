"""The check's own rules (tests/__main__.py): every test that ``SERIAL`` names exists, so a
renamed one cannot slip onto two workers unnoticed."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SERIAL

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("entry", SERIAL)
def test_serial_names_a_test_that_exists(entry: str) -> None:
    path, _, name = entry.partition("::")
    assert (ROOT / path).is_file(), entry
    assert not name or f"\ndef {name}(" in (ROOT / path).read_text(), entry
