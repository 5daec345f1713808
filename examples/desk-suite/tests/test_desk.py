"""Everything a suite plug-in needs as tests: ratchet's conformance kit on this suite."""

from ratchet.conformance.testing import SuiteConformance


class TestDesk(SuiteConformance):
    suite_spec = "desk"
    tasks_per_split = 6
