"""Task suites: sources of Tasks with verifiers and fixed, disjoint train/dev/test splits.

A suite is a plug-in registered under the entry-point group `ratchet.suites`
(see `suites.registry`); the two shipped here are ordinary plug-ins too.
"""

from ratchet.suites.base import ActionError, Episode, StepResult, Suite
from ratchet.suites.registry import available_suites, get_suite, suite_from

__all__ = ["ActionError", "Episode", "StepResult", "Suite", "available_suites", "get_suite", "suite_from"]
