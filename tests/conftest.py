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
    props = dict(getattr(report, "user_properties", ()))
    if "reliability" not in props: return
    module, case, _ = props["reliability"]
    if report.skipped and hasattr(report, "wasxfail"): outcome = f"XFAIL ({report.wasxfail})"
    elif report.skipped: outcome = "skipped (module not there yet)"
    elif report.passed and hasattr(report, "wasxfail"): outcome = "XPASS (fixed? remove the xfail)"
    elif report.passed: outcome = props.get("reliability_outcome", "ok")
    elif "XPASS(strict)" in str(report.longrepr): outcome = "XPASS (fixed? remove the xfail)"
    else: outcome = "FAILED"
    _RELIABILITY.append((module, case, outcome))


REPORT = os.path.join(ROOT, ".pytest_cache", "relpos-reliability.txt")   # the full table (.pytest_cache is git-ignored)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    "A few lines: counts per outcome, then every case that failed, is xfailed/xpassed or skipped; the full table goes to REPORT."
    if not _RELIABILITY: return
    tr = terminalreporter
    tr.section("relpos reliability: bad-input matrix")
    wm = max(len(m) for m, _, _ in _RELIABILITY)
    wc = max(len(c) for _, c, _ in _RELIABILITY)
    counts, modules = defaultdict(int), defaultdict(int)
    lines = []
    for module, case, outcome in sorted(_RELIABILITY):
        lines.append(f"{module:<{wm}}  {case:<{wc}}  {outcome}")
        counts[outcome.split(' (')[0]] += 1
        modules[module] += 1
    summary = f"{len(_RELIABILITY)} cases: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items()))
    os.makedirs(os.path.dirname(REPORT), exist_ok=True)
    with open(REPORT, "w") as f: f.write("\n".join(lines + ["", summary]) + "\n")
    tr.write_line(f"{summary}, over {len(modules)} public classes and functions")
    notable = [l for l, (_, _, o) in zip(lines, sorted(_RELIABILITY)) if o.startswith(("FAILED", "XPASS", "XFAIL", "skipped"))]
    for l in notable[:10]: tr.write_line("  " + l)
    if len(notable) > 10: tr.write_line(f"  ... and {len(notable) - 10} more")
    tr.write_line(f"full table: {os.path.relpath(REPORT)}")


import pytest

@pytest.fixture(autouse=True)
def _fresh_dynamo():
    "Every test compiles from scratch: Dynamo's caches are per process (its recompile limit of 8 per code object, automatic"
    " dynamic shapes), so a test's outcome would otherwise depend on which tests ran before it in the same worker."
    if 'torch._dynamo' in sys.modules: sys.modules['torch._dynamo'].reset()
    yield
