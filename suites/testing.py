"""Not a module: the conformance kit is `ratchet.conformance` (contract 2's first release
named this path in a docstring). Importing it fails with the path to use instead."""

raise ImportError(
    "ratchet.suites.testing does not exist: the suite conformance kit is ratchet.conformance "
    "(from ratchet.conformance.testing import SuiteConformance; from ratchet.conformance import "
    "check_suite); see docs/extending.md, 'Porting a plug-in from the first contract'",
    name=__name__,
)
