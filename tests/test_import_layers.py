"""The floors of the code (docs/architecture.md), beyond what `lint-imports` checks in `make test`:

- the import-linter contracts in pyproject.toml hold (so a bare `pytest` run catches a broken
  floor too, naming the import);
- the model imports nothing of torch.distributed (import-linter can forbid `torch` as a whole,
  not one of its subpackages);
- every function-local import says why it is not at the top (a comment on it or on the lines
  just above its group): such an import is allowed only to keep a command's start-up light,
  never to hide a circle.
"""

from __future__ import annotations

import ast
import io
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "phalanx"


def _sources() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_import_contracts_hold():
    lint = shutil.which("lint-imports") or str(Path(sys.executable).with_name("lint-imports"))
    if not Path(lint).exists():
        pytest.skip("import-linter is not installed (pip install -e '.[test]')")
    result = subprocess.run([lint, "--no-cache"], cwd=PACKAGE.parent, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


def test_model_imports_no_torch_distributed():
    offenders = []
    for path in sorted((PACKAGE / "model").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}:{node.lineno} {name}" for name in names if name.startswith("torch.distributed")]
    assert not offenders, f"the model imports torch.distributed: {offenders}"


def _comment_lines(text: str) -> set[int]:
    return {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(text).readline) if tok.type == tokenize.COMMENT}


def _unexplained_local_imports(path: Path, root: Path = PACKAGE.parent) -> list[str]:
    text = path.read_text()
    lines, comments = text.splitlines(), _comment_lines(text)
    local = sorted({node.lineno: node for fn in ast.walk(ast.parse(text)) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                    for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}.values(), key=lambda n: n.lineno)
    spans = {line: node for node in local for line in range(node.lineno, node.end_lineno + 1)}
    missing = []
    for node in local:
        if any(line in comments for line in range(node.lineno, node.end_lineno + 1)):
            continue
        above = node.lineno - 1  # up through blank lines and the other imports of its group
        while above >= 1 and (not lines[above - 1].strip() or above in spans) and above not in comments:
            above -= 1
        if above not in comments:
            missing.append(f"{path.relative_to(root)}:{node.lineno} {lines[node.lineno - 1].strip()}")
    return missing


def test_every_function_local_import_says_why():
    missing = [entry for path in _sources() for entry in _unexplained_local_imports(path)]
    assert not missing, "function-local imports without a comment saying why:\n" + "\n".join(missing)


def test_the_check_finds_an_unexplained_import(tmp_path):
    """The rule above can fail: an import inside a function with no comment is reported."""
    module = tmp_path / "example.py"
    module.write_text("def f():\n    import json\n    return json\n\n\ndef g():\n    # why: here\n    import json\n")
    assert _unexplained_local_imports(module, tmp_path) == ["example.py:2 import json"]
