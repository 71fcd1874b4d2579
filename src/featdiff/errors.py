"""The user's-problem exception: a bad file, a flag, a build without a symbol.

`cli.main` is the only place that turns it into a one-line message and exit code 2.
"""


class InputError(Exception):
    """Unusable input. The message names the file, what was expected, what was found, the fix."""
