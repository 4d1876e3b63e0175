"Shared pytest set-up: import relpos from this checkout, and print the reliability table at the end of the run."
import os, sys
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path: sys.path.insert(0, ROOT)

# Outcomes of the bad-input matrix (tests/test_reliability.py). Each case records
# ('reliability', (module, case, expected)) as a user property; with pytest-xdist the
# reports travel to the controller, so the table is complete under `-n 2` as well.
_RELIABILITY = []


def pytest_runtest_logreport(report):
    if report.when != "call" and not (report.when == "setup" and report.skipped): return
    for key, value in getattr(report, "user_properties", ()):
        if key != "reliability": continue
        module, case, expected = value
        if report.skipped and hasattr(report, "wasxfail"): outcome = "XFAIL (known bug)"
        elif report.skipped: outcome = "skipped"
        elif report.passed and hasattr(report, "wasxfail"): outcome = "XPASS"
        elif report.passed: outcome = expected
        else: outcome = "FAILED"
        _RELIABILITY.append((module, case, outcome))


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if not _RELIABILITY: return
    tr = terminalreporter
    tr.section("relpos reliability: bad-input matrix")
    width = max(len(f"{m}.{c}") for m, c, _ in _RELIABILITY)
    counts = defaultdict(int)
    for module, case, outcome in sorted(_RELIABILITY):
        tr.write_line(f"{module + '.' + case:<{width}}  {outcome}")
        counts[outcome] += 1
    tr.write_line(f"{len(_RELIABILITY)} cases: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))
