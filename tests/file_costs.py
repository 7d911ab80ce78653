"""How long each test file takes, so that the suite's workers start on the longest files first.

pytest-xdist hands whole files to its workers (`--dist loadfile`) in collection order when told not to
reorder them (`--no-loadscope-reorder`, as `launch/test.sh` runs it); by default it would hand out the files
with the most tests first, which leaves the few long end-to-end files (one launch each, a minute or more)
for last, when one worker runs them alone.  `conftest.py` sorts the collected files by the seconds below,
longest first (a file not listed counts as 0 s: it goes after the listed ones, in collection order).

Refresh the table from a whole run's JUnit report:

    bash launch/test.sh --junitxml=/tmp/suite.xml
    python tests/file_costs.py /tmp/suite.xml > tests/file_costs.json
"""
from __future__ import annotations

import collections
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

TABLE = Path(__file__).with_name("file_costs.json")


def load() -> dict[str, float]:
    """test file name (``test_x.py``) -> seconds, as measured last."""
    return json.loads(TABLE.read_text(encoding="utf-8"))["seconds"] if TABLE.is_file() else {}


def from_junit(report: Path) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of its tests) in a JUnit report."""
    seconds: dict[str, float] = collections.Counter()
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").split(".")
        name = next((part for part in module if part.startswith("test_")), None)
        if name:
            seconds[f"{name}.py"] += float(case.get("time") or 0.0)
    return dict(seconds)


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    seconds = from_junit(Path(argv[0]))
    table = {"source": "a whole run's JUnit report, seconds per file (python tests/file_costs.py REPORT)",
             "seconds": {name: round(s, 1) for name, s in sorted(seconds.items(), key=lambda kv: -kv[1])}}
    print(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
