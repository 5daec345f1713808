"""Conformance kits for plug-in authors: what a suite must promise, checked on the real thing.

`check_suite(suite)` runs every check of `conformance/suite.py`; `conformance/testing.py`
turns them into pytest tests; `ratchet suites check NAME` prints them. `conformance/budget.py`
counts reply tokens for the output-budget check.
"""

from ratchet.conformance.suite import CHECKS, CheckResult, CheckSkipped, ConformanceError, check_suite

__all__ = ["CHECKS", "CheckResult", "CheckSkipped", "ConformanceError", "check_suite"]
