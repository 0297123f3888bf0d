"""tests/xdist_scheduling.py: which tests `pytest -n N` keeps together on one worker, and in
what order it hands the units out."""

from __future__ import annotations

from types import SimpleNamespace

from tests.xdist_scheduling import SharedFixtureScheduling

CONFTEST = '''
@pytest.fixture(scope="module")
def shared_run(tmp_path_factory):
    return 1


@pytest.fixture
def per_test():
    return 2
'''


def _scheduler(root) -> SharedFixtureScheduling:
    values = {"numprocesses": 2, "tx": ["popen"] * 2, "dist": "load", "maxprocesses": None}  # as `-n 2` sets them
    config = SimpleNamespace(rootpath=root, option=SimpleNamespace(loadscopereorder=False, **values),
                             getvalue=values.get)
    return SharedFixtureScheduling(config)


def test_modules_with_shared_fixtures_are_one_unit_and_the_rest_single_tests(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text(CONFTEST)
    (tests / "test_own.py").write_text('@pytest.fixture(scope="module")\ndef run():\n    return 1\n')
    (tests / "test_uses_conftest.py").write_text("def test_a(shared_run):\n    pass\n")
    (tests / "test_plain.py").write_text("def test_a(per_test):\n    pass\n")
    scheduler = _scheduler(tmp_path)
    assert scheduler.config.option.loadscopereorder is True  # grouped units first (the module's docstring)
    assert scheduler._split_scope("tests/test_own.py::test_a[1]") == "tests/test_own.py"
    assert scheduler._split_scope("tests/test_own.py::Case::test_b") == "tests/test_own.py"
    assert scheduler._split_scope("tests/test_uses_conftest.py::test_a") == "tests/test_uses_conftest.py"
    assert scheduler._split_scope("tests/test_plain.py::test_a") == "tests/test_plain.py::test_a"
