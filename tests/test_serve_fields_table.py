"""docs/serve.md's table of request fields is the one the request checks read: a field added,
honoured or refused in `phalanx/serve/api_fields.py` without the docs following fails here."""

from pathlib import Path

from phalanx.serve.api_fields import FIELDS, markdown_table

DOCS = Path(__file__).resolve().parents[1] / "docs" / "serve.md"


def test_docs_table_is_the_field_table():
    text = DOCS.read_text()
    begin, end = "<!-- fields:begin -->\n", "<!-- fields:end -->"
    assert begin in text and end in text, "docs/serve.md lost its field table's markers"
    shown = text[text.index(begin) + len(begin):text.index(end)]
    assert shown == markdown_table(), "regenerate it: python -m phalanx.serve.api_fields"
    assert len(shown.strip().splitlines()) == len(FIELDS) + 2
