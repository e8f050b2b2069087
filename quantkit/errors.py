"""User-facing errors: the CLI prints their message on one line and exits with `exit_code`."""


class QuantkitError(Exception):
    """A problem with the user's input or environment (exit 2 by default)."""

    exit_code = 2

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class InputError(QuantkitError):
    """Bad arguments, missing files, unsupported models or data."""


class RunError(QuantkitError):
    """Something failed while running (disk full, numerical failure that could not be recovered)."""

    exit_code = 1
