"""User-facing errors: one line, no traceback, exit code 2 from the CLI."""


class OnnxfuseError(Exception):
    """An error whose message is meant for the user as it is."""


class PatternError(OnnxfuseError):
    """A pattern file is invalid; the message names the file and the field."""


class OnnxfuseWarning(UserWarning):
    """Something the user should know that did not stop the optimizer (also in Report.warnings)."""
