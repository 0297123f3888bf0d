"""`phalanx match` on files: the pattern file's rules, folders, the exact JSON keys, and a
one-line error for each bad input."""

from __future__ import annotations

import json

import pytest

from phalanx.cli import main
from phalanx.kernels.patterns import parse_patterns
from phalanx.testing.cli_errors import assert_cli_error


def _run(argv, capsys) -> dict:
    with pytest.raises(SystemExit) as exit_info:
        main(["match", *argv])
    assert exit_info.value.code == 0
    return json.loads(capsys.readouterr().out)


def _fails(argv, capsys, message):
    assert_cli_error(["match", *argv], capsys, message, one_line=False)


def test_pattern_file_rules():
    """Split on \\n only: \\r and spaces stay, empty lines are skipped and not counted."""
    assert parse_patterns(b"ab\r\n\n c\n\nd\t\n") == [b"ab\r", b" c", b"d\t"]
    assert parse_patterns(b"\xff\x00x") == [b"\xff\x00x"]


def test_json_keys_positions_and_folders(tmp_path, capsys):
    (tmp_path / "patterns.txt").write_bytes(b"ab\n\naba\r\nb\n")
    folder = tmp_path / "texts"
    (folder / "sub").mkdir(parents=True)
    (folder / "b.txt").write_bytes(b"abab")
    (folder / "a.txt").write_bytes(b"aba\r\n")
    (folder / "sub" / "c.txt").write_bytes(b"b")
    single = tmp_path / "single.txt"
    single.write_bytes(b"xab")
    result = _run(["--patterns", str(tmp_path / "patterns.txt"), "--json", "--positions", str(single), str(folder)], capsys)
    assert list(result) == ["matches", "per_pattern", "bytes", "seconds", "positions"]
    # inputs: single.txt, texts/a.txt, texts/b.txt, texts/sub/c.txt (folders in sorted path order)
    expected = [[0, 1, 0], [0, 2, 2], [1, 0, 0], [1, 0, 1], [1, 1, 2], [2, 0, 0], [2, 1, 2], [2, 2, 0], [2, 3, 2], [3, 0, 2]]
    assert result["positions"] == expected
    assert result["per_pattern"] == [4, 1, 5] and result["matches"] == 10 and result["bytes"] == 3 + 5 + 4 + 1
    plain = _run(["--patterns", str(tmp_path / "patterns.txt"), "--json", str(single)], capsys)
    assert list(plain) == ["matches", "per_pattern", "bytes", "seconds"]


def test_duplicate_pattern_names_both_lines(tmp_path, capsys):
    (tmp_path / "p.txt").write_bytes(b"abc\n\nxyz\nabc\n")
    (tmp_path / "t.txt").write_bytes(b"abc")
    _fails(["--patterns", str(tmp_path / "p.txt"), str(tmp_path / "t.txt")], capsys, "line 4 repeats the pattern of line 1")


def test_empty_pattern_file(tmp_path, capsys):
    (tmp_path / "p.txt").write_bytes(b"\n\n")
    (tmp_path / "t.txt").write_bytes(b"abc")
    _fails(["--patterns", str(tmp_path / "p.txt"), str(tmp_path / "t.txt")], capsys, "holds no patterns")


def test_missing_pattern_file_and_inputs(tmp_path, capsys):
    (tmp_path / "p.txt").write_bytes(b"a\n")
    _fails(["--patterns", str(tmp_path / "nope.txt"), str(tmp_path / "p.txt")], capsys, "cannot read the pattern file")
    _fails(["--patterns", str(tmp_path / "p.txt"), str(tmp_path / "missing.txt")], capsys, "does not exist")
    (tmp_path / "broken").symlink_to(tmp_path / "gone")
    _fails(["--patterns", str(tmp_path / "p.txt"), str(tmp_path / "broken")], capsys, "does not exist")


def test_bad_algorithm_device_and_nproc(tmp_path, capsys):
    (tmp_path / "p.txt").write_bytes(b"a\n")
    (tmp_path / "t.txt").write_bytes(b"abc")
    common = ["--patterns", str(tmp_path / "p.txt"), str(tmp_path / "t.txt")]
    _fails([*common, "--algorithm", "kmp"], capsys, "choose one of auto, wu-manber, pfac")
    _fails([*common, "--device", "tpu"], capsys, "choose cpu or cuda")
    _fails([*common, "--nproc", "0"], capsys, "must be at least 1")
