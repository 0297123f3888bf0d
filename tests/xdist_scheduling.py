"""How `pytest -n N` hands tests to its workers: a module whose tests share a module-scoped
fixture goes to one worker whole; every other test goes wherever a worker is free.

Why: pytest-xdist's default (`--dist load`) deals the first quarter of the tests out one at a
time, round robin, and the rest in chunks, so most modules end up on both workers, and each
worker then builds the module's fixtures. Here those fixtures are the expensive part of the
suite: forked multi-rank training runs (test_hybrid_layouts' 4-rank group trains ten layouts
in about 80 s), servers started once per module, reference runs of one process. Built twice,
they cost their CPU twice on a two-core machine. `--dist loadfile` avoids that but also groups
the many cheap modules, which leaves the two workers unevenly loaded at the end.
(`--dist loadgroup` with `xdist_group` marks would say it per test, but pytest-xdist 3.8
renames `item._nodeid`, which pytest 9.2 no longer reads, so the marks have no effect.)

Which modules are grouped is read from their source, in the controller (which imports no test
module): a `scope="module"`, `scope="class"` or `scope="package"` fixture of their own, or a
use of a conftest.py fixture of such a scope (by name). The grouped modules are handed out
first, those of more tests first, then the single tests in collection order: the many short
single tests at the end let both workers finish together, where a module of shared fixtures
last in line (the serving modules' servers, test_world_change's 4-rank run) would leave one
worker idle while the other ran it.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

from xdist.scheduler import LoadScopeScheduling

_SHARED_SCOPE = re.compile(r"""scope\s*=\s*["'](module|class|package)["']""")
_FIXTURE_DEF = re.compile(r"""@pytest\.fixture\(\s*scope\s*=\s*["'](?:module|class|package)["'][^)]*\)\s*\n\s*def\s+(\w+)""")


class SharedFixtureScheduling(LoadScopeScheduling):
    """LoadScopeScheduling whose scope is the module for modules with shared fixtures and the
    test itself for the others."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        self.rootdir = Path(config.rootpath)
        # The base class's order: units by number of tests, largest first, ties in collection
        # order; so the grouped modules go first and the single tests last (module docstring).
        config.option.loadscopereorder = True

    @functools.cached_property
    def _conftest_fixtures(self) -> re.Pattern | None:
        names = []
        for conftest in self.rootdir.glob("tests/**/conftest.py"):
            names += _FIXTURE_DEF.findall(conftest.read_text())
        return re.compile(r"\b(" + "|".join(map(re.escape, names)) + r")\b") if names else None

    @functools.lru_cache(maxsize=None)
    def _shares_fixtures(self, module: str) -> bool:
        path = self.rootdir / module
        if not path.is_file() or path.name == "conftest.py":
            return False
        text = path.read_text()
        uses_conftest = self._conftest_fixtures is not None and self._conftest_fixtures.search(text)
        return bool(_SHARED_SCOPE.search(text) or uses_conftest)

    def _split_scope(self, nodeid: str) -> str:
        module = nodeid.split("::", 1)[0]
        return module if self._shares_fixtures(module) else nodeid
