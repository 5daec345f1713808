"""Errors a user can act on.

Every failure caused by input or environment (unknown suite, unreachable endpoint,
bad config, missing Java, a port in use) is a `RatchetError`: the CLI prints its one
line and exits non-zero. Anything else is a bug in ratchet and keeps its traceback.
"""

from __future__ import annotations


class RatchetError(Exception):
    """A problem the user can fix; `str()` is one line: what is wrong, then what to do."""

    exit_code = 2

    def __init__(self, problem: str, fix: str = "") -> None:
        self.problem = problem
        self.fix = fix
        super().__init__(one_line(f"{problem}. {fix}".strip() if fix else problem))


# what str.splitlines() breaks at, each written as its escape
_BREAKS = {ord(c): repr(c)[1:-1] for c in "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"}


def one_line(text: str) -> str:
    """`text` with line breaks written as escapes: a message quotes paths and names the user
    chose, and one holding a newline must still print as one line."""
    return text.translate(_BREAKS)


class ConfigError(RatchetError):
    """Settings file, environment or flags are invalid."""


class UnknownSuiteError(RatchetError):
    """A suite name that no installed plug-in provides."""


class SuiteVersionError(RatchetError):
    """An evolution's stored rollouts were played on another version of its suite."""


class EndpointError(RatchetError):
    """The model endpoint cannot be reached or answers wrongly."""


class EnvironmentMissingError(RatchetError):
    """A system dependency (e.g. Java 17) is not installed."""


class PortInUseError(RatchetError):
    """The embedded server's port is taken."""


class TransientModelError(Exception):
    """A model call that may succeed when retried (timeouts, 5xx, dropped connections)."""


class SkillFileError(RatchetError):
    """A SKILL.md (or its tool files) is malformed, or its content no longer matches its hash."""


class CandidateStateError(RatchetError):
    """A lifecycle change that is not allowed (wrong status, unknown candidate, lost a race)."""


class SkillStateError(CandidateStateError):
    """A skill's lifecycle change that is not allowed."""


class AdapterError(RatchetError):
    """An adapter that is missing, corrupt, or whose files no longer match its registry hash."""


class AdapterStateError(CandidateStateError):
    """An adapter version's lifecycle change that is not allowed."""


class PrefectStartError(RatchetError):
    """Prefect's ephemeral API server did not come up."""


class StateFileError(RatchetError):
    """A state file under the data dir (audit log, trajectory DB, journal, MLflow's database)
    is damaged or cannot be written."""


class DataDirError(RatchetError):
    """The data dir cannot be created or written (a read-only file system, a file in the way)."""
