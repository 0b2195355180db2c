#!/usr/bin/env python3
"""``count_cases.py PHASE FLOOR REPORT.xml``: fail when a pytest run selected fewer cases than its floor.

.ci/run selects each phase's cases by -k substrings, so a renamed case would silently leave its
phase; every phase's pytest writes a JUnit report (--junitxml) and this checks how many cases it
held (passed, failed, errors and skips: a skip is reported by pytest itself) against the floor
that .ci/run states for it. Standard library only: it runs with the system's python3.
"""

from __future__ import annotations

import sys
import xml.etree.ElementTree as ET


def count(path: str) -> tuple:
    """``(cases, skipped)`` of a JUnit report written by pytest."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return (sum(int(s.get("tests", 0)) for s in suites), sum(int(s.get("skipped", 0)) for s in suites))


def seconds_by_file(path: str, most: int = 12) -> list:
    """The ``most`` test files that took longest in a JUnit report, as ``(seconds, file)``, slowest first
    (setup and teardown included: pytest's JUnit times do), so each CI log says where a phase's time went."""
    totals: dict = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        module = case.get("classname", "?").split("::")[0]
        totals[module] = totals.get(module, 0.0) + float(case.get("time", 0) or 0)
    return sorted(((t, m) for m, t in totals.items()), reverse=True)[:most]


def main(argv: list) -> int:
    if len(argv) != 3 or not argv[1].isdigit():
        print(__doc__.splitlines()[0], file=sys.stderr)
        return 2
    phase, floor, path = argv[0], int(argv[1]), argv[2]
    try:
        cases, skipped = count(path)
    except (OSError, ET.ParseError) as exc:
        print(f"=== {phase}: no JUnit report at {path} ({exc}); cannot tell how many cases ran", file=sys.stderr)
        return 1
    print(f"=== {phase}: {cases} cases ({cases - skipped} ran, {skipped} skipped); its floor is {floor}")
    print("    slowest files: " + ", ".join(f"{module} {t:.0f}s" for t, module in seconds_by_file(path)))
    if cases < floor:
        print(f"=== {phase}: FAILED: {cases} cases, fewer than the {floor} this phase must run: a case was renamed "
              "or removed out of the phase's -k selection; fix the selection in .ci/run, or lower the phase's "
              "floor there if the cases are gone on purpose", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
