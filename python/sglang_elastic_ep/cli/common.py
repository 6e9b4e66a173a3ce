"""Exit codes, environment variable names and the error type shared by the subcommands."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CONFLICT = 3

API_KEY_ENV = "SGLANG_EEP_API_KEY"
URL_ENV = "SGLANG_EEP_URL"


class CliError(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
