"""A small training corpus for tests that compare runs with each other."""

from __future__ import annotations

import sysconfig
from pathlib import Path

ONE_FILE_CORPUS = str(Path(sysconfig.get_paths()["stdlib"]) / "typing.py")
"""One standard-library module (120 kB), the kind of text of the default corpus. Reading the
whole default corpus (700+ files) cost each rank of each test run more than its training
steps; tests that compare runs on the same data need no more than this."""
