"""Errors the user can fix.

A `UserError` carries a message that names the field or file at fault and says what to do.
The CLI prints it without a traceback and exits with `hlat_api.ExitCode.CONFIG_ERROR`, which
the operator treats as permanent (restarting the gang cannot fix a bad config or dataset).
"""


class UserError(Exception):
    """Bad input: a config value, a data file, a tokenizer, or a checkpoint the user pointed at."""


def first_line(err: BaseException, limit: int = 300) -> str:
    """An error's first line for a log message, at most `limit` characters: its repr when its
    message is empty (a dropped connection can raise one without text, and logging the error
    must never raise in its place); `HTTP 403 Forbidden` for the Kubernetes client's errors
    (whose first line is just the status)."""
    status, reason = getattr(err, "status", None), getattr(err, "reason", None)
    if isinstance(status, int) and isinstance(reason, str):  # the Kubernetes client's errors
        return f"HTTP {status} {reason}"[:limit]
    lines = str(err).splitlines()
    return (lines[0] if lines and lines[0].strip() else repr(err))[:limit]
