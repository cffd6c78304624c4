"""Exit codes of ``dataplane`` and the one error type commands raise to end with one."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # the endpoint refused the request (not found, invalid argument, ...)
EXIT_USAGE = 2  # the command line is wrong (argparse uses 2 as well)
EXIT_UNREACHABLE = 3  # no answer from the endpoint, or a watch stream dropped
EXIT_AUTH = 4  # token missing or wrong, or the endpoint refuses mutations
EXIT_PIPE = 141  # stdout's reader went away (`| head`): 128 + SIGPIPE, as a shell reports it

EPILOG = (
    "exit codes: 0 ok, 1 request refused, 2 usage, 3 endpoint unreachable, 4 auth, "
    "141 output pipe closed by its reader"
)


class CliError(Exception):
    """A failure to report as one ``dataplane: error: ...`` line and an exit code."""

    def __init__(self, message: str, exit_code: int = EXIT_FAILED):
        super().__init__(message)
        self.exit_code = exit_code
