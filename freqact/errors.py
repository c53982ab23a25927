"""The error types of freqact that mean "the caller asked for something invalid".

Argument and setting checks (`freqact._validate`, the codec and model settings, `RunConfig`) raise
`UsageError`, or `UsageTypeError` when a value has the wrong type. Both subclass the built-in types
the public functions document (ValueError, and TypeError for the second), so `except ValueError`
keeps working; `freqact.cli.main` turns them into one line on stderr and exit code 2, while any
other TypeError or KeyError is a bug and keeps its traceback.

This module imports nothing, so the command line can use it before torch is loaded.
"""


class UsageError(ValueError):
    """A bad argument, setting or input named by the caller; the message says which and why."""


class UsageTypeError(UsageError, TypeError):
    """A setting or argument of the wrong type (also a TypeError, as Python's own checks raise)."""
