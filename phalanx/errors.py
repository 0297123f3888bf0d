"""The one exception type for mistakes a user can fix (bad flags, files, plans).

The CLI prints these as a single line and exits with status 2; anything else is a bug and
keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's input, reported in one line without a traceback."""
