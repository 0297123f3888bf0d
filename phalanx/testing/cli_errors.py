"""The check every bad-input test makes: the command exits with status 2 and says what is
wrong in one line, `phalanx: error: ...`, with no traceback."""

from __future__ import annotations

import pytest

from phalanx.cli import main


def assert_cli_error(argv: list[str], capsys, *messages: str, one_line: bool = True, ignore: tuple[str, ...] = ()) -> str:
    """Run `phalanx argv`; return its error line after checking it holds every message.

    `one_line=False` allows other lines (warnings) before it; lines starting with one of
    `ignore` (a progress bar's) are not counted."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    err = [line for line in capsys.readouterr().err.strip().splitlines() if not line.startswith(ignore or "\0")]
    assert exit_info.value.code == 2, (exit_info.value.code, err)
    assert err and err[-1].startswith("phalanx: error:"), err
    assert not one_line or len(err) == 1, err
    assert not any("Traceback" in line for line in err), err
    assert all(message in err[-1] for message in messages), err[-1]
    return err[-1]
