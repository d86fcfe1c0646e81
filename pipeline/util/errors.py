"""The one exception type for mistakes a user can fix (bad input, missing files)."""


class UserError(Exception):
    """A problem with the user's input: reported as one line on stderr, never a traceback."""
