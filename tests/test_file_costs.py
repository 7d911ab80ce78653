"""The suite's order: the measured seconds per test file (tests/file_costs.json), read from a JUnit
report, and the collection sorted longest file first."""
from __future__ import annotations

import json
from pathlib import Path

import file_costs

TESTS = Path(__file__).resolve().parent

REPORT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="4">
<testcase classname="tests.test_a" name="test_one" time="1.5"/>
<testcase classname="tests.test_a.TestGroup" name="test_two" time="2.25"/>
<testcase classname="tests.test_b" name="test_three[x]" time="0.5"/>
<testcase classname="conftest" name="collect" time="9.0"/>
</testsuite></testsuites>"""


def test_a_junit_report_gives_the_seconds_of_each_file(tmp_path, capsys):
    report = tmp_path / "r.xml"
    report.write_text(REPORT)
    assert file_costs.from_junit(report) == {"test_a.py": 3.75, "test_b.py": 0.5}
    assert file_costs.main([str(report)]) == 0
    assert list(json.loads(capsys.readouterr().out)["seconds"].items()) == [("test_a.py", 3.8), ("test_b.py", 0.5)]


def test_the_table_names_only_test_files_that_exist():
    seconds = file_costs.load()
    assert seconds, "tests/file_costs.json is missing or empty"
    missing = sorted(name for name in seconds if not (TESTS / name).is_file())
    assert not missing, f"tests/file_costs.json names files that are gone: {missing}"


def test_the_collection_runs_the_longest_files_first(request):
    # This session's own collection, as the hook in conftest.py sorted it.
    seconds = file_costs.load()
    order = list(dict.fromkeys(item.path.name for item in request.session.items))
    costs = [seconds.get(name, 0.0) for name in order]
    assert costs == sorted(costs, reverse=True), list(zip(order, costs))[:10]
