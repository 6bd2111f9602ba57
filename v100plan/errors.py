"""Domain errors, the exit-code table, and the one place errors become messages.

Exit codes (documented in README.md, "Exit codes"):

  0  success: everything ran and passed (or only warned)
  1  a check failed or errored (probe case, acceptance scenario)
  2  bad input: unknown id, unparsable option, invalid or missing file
  3  nothing could be measured: every case was waived (e.g. no NVIDIA driver)
  4  environment problem: a dependency, host or service needed is missing or unreachable
  70 internal error (a bug in v100plan): set V100PLAN_DEBUG=1 to see the traceback
  130 interrupted (Ctrl-C): the command stopped before it finished
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_CHECK_FAILED = 1
EXIT_BAD_INPUT = 2
EXIT_NOTHING_MEASURED = 3
EXIT_ENVIRONMENT = 4
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

EXIT_CODES = {
    EXIT_OK: "success: everything ran and passed (or only warned)",
    EXIT_CHECK_FAILED: "a check failed or errored",
    EXIT_BAD_INPUT: "bad input: unknown id, unparsable option, invalid or missing file",
    EXIT_NOTHING_MEASURED: "nothing could be measured: every case was waived",
    EXIT_ENVIRONMENT: "environment problem: a dependency, host or service is missing or unreachable",
    EXIT_INTERNAL: "internal error in v100plan (V100PLAN_DEBUG=1 shows the traceback)",
    EXIT_INTERRUPTED: "interrupted (Ctrl-C)",
}


class V100planError(Exception):
    """Base of every error a user can cause or fix. ``hint`` names the next thing to do."""

    exit_code = EXIT_BAD_INPUT

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint


class BadInput(V100planError):
    """An option or argument the user gave cannot be used."""


class UnknownId(BadInput):
    """A catalogue id that does not exist; the message lists the valid ones."""

    def __init__(self, kind: str, given: str, valid: list[str]):
        super().__init__(
            f"unknown {kind} id {given!r}; valid ids: {', '.join(sorted(valid))}",
            hint=f"run `v100plan profiles list` to see every {kind} with its description",
        )


class DocumentError(BadInput):
    """A JSON document that cannot be read: missing, not JSON, wrong schema or version."""

    def __init__(self, source: str, problem: str, json_path: str | None = None, hint: str | None = None):
        where = f"{source}" + (f" at {json_path}" if json_path else "")
        super().__init__(f"{where}: {problem}", hint=hint or "run `v100plan profiles validate FILE` for every problem in it")
        self.source = source
        self.json_path = json_path
        self.problem = problem


class EnvironmentProblem(V100planError):
    """Something outside the user's input is missing: a package, a driver, a host, a service."""

    exit_code = EXIT_ENVIRONMENT


class NothingMeasured(V100planError):
    exit_code = EXIT_NOTHING_MEASURED


class ChecksFailed(V100planError):
    exit_code = EXIT_CHECK_FAILED
