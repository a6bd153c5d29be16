"""The suite's own split across pytest-xdist workers (tests/helpers/xdist_groups.py): tests that share a set-up
wider than one test land in one group, so that set-up runs once; tests that share nothing are left free."""

from __future__ import annotations

import pytest

from tests.helpers.xdist_groups import durations_from_junit, longest_first, mark_groups, threads_per_worker

pytest_plugins = ["pytester"]

SOURCE = '''
import pytest

@pytest.fixture(scope="session")
def trained_run():
    return 1

@pytest.fixture(scope="session")
def cluster():
    return 2

@pytest.fixture(scope="module")
def browser():
    return 3

@pytest.fixture
def per_test():
    return 4

def test_reads_the_run(trained_run): pass
def test_reads_the_run_and_the_cluster(trained_run, cluster): pass
def test_uses_the_cluster(cluster): pass
def test_drives_the_browser(browser): pass
def test_drives_it_again(browser, per_test): pass
def test_shares_nothing(per_test, tmp_path_factory): pass
'''


def groups(pytester: pytest.Pytester) -> dict[str, str | None]:
    items = pytester.getitems(SOURCE)
    mark_groups(items, pytester.path)
    return {item.name: (mark.args[0] if (mark := item.get_closest_marker("xdist_group")) else None) for item in items}


def test_tests_sharing_a_fixture_through_another_test_share_one_group(pytester):
    found = groups(pytester)
    run = found["test_reads_the_run"]
    assert run is not None
    assert found["test_reads_the_run_and_the_cluster"] == run and found["test_uses_the_cluster"] == run


def test_a_module_fixture_groups_its_module_and_per_test_fixtures_group_nothing(pytester):
    found = groups(pytester)
    browser = found["test_drives_the_browser"]
    assert browser is not None and browser.endswith("::browser")
    assert found["test_drives_it_again"] == browser != found["test_reads_the_run"]
    assert found["test_shares_nothing"] is None  # pytest's own session fixtures are shared by every test


def test_tests_that_share_nothing_go_longest_first_and_groups_keep_their_order(pytester):
    items = pytester.getitems(SOURCE)
    mark_groups(items, pytester.path)
    grouped = [i.name for i in items if i.get_closest_marker("xdist_group")]
    free = {i.nodeid: i for i in items if not i.get_closest_marker("xdist_group")}
    assert len(free) == 1
    longest_first(items, {next(iter(free)): 30.0})
    assert items[0].name == "test_shares_nothing"  # before every group, in collection order
    assert [i.name for i in items[1:]] == grouped


def test_recorded_durations_leave_out_grouped_and_short_tests(tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="tests.test_jobs" name="test_long" time="28.04"/>'
                     '<testcase classname="tests.test_jobs" name="test_short[1]" time="0.2"/>'
                     '<testcase classname="tests.test_kit.test_x@test_kit.py" name="dry_run" time="50"/>'
                     '</testsuite></testsuites>')
    assert durations_from_junit(junit) == {"tests/test_jobs.py::test_long": 28.0}


@pytest.mark.parametrize(("cores", "workers", "threads"), [(2, "2", 1), (16, "4", 4), (2, "3", 1), (8, None, None)])
def test_each_worker_takes_its_share_of_the_cores(monkeypatch, cores, workers, threads):
    monkeypatch.setattr("os.cpu_count", lambda: cores)
    if workers is None:
        monkeypatch.delenv("PYTEST_XDIST_WORKER_COUNT", raising=False)
    else:
        monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", workers)
    assert threads_per_worker() == threads


SHARED = """
import pytest

@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    import os
    with open({log!r}, "a") as f:
        f.write("set up on " + os.environ.get("PYTEST_XDIST_WORKER", "?") + "\\n")
    return 1

@pytest.mark.parametrize("n", range(6))
def test_reads_the_dry_run(dry_run, n): pass

@pytest.mark.parametrize("n", range(6))
def test_shares_nothing(n): pass
"""

CONFTEST = """
from pathlib import Path

import pytest

from tests.helpers import xdist_groups

@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    if xdist_groups.grouping(config):
        xdist_groups.mark_groups(items, Path(__file__).parent)
"""


def test_under_two_real_workers_a_module_fixture_is_set_up_once(pytester, monkeypatch):
    """The workers collect with `dist` rewritten to "no": the grouping must still happen there."""
    from tests.helpers.cli import ROOT

    log = pytester.path / "setups.log"
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_kit=SHARED.format(log=str(log)))
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    result = pytester.runpytest_subprocess("-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=12)
    assert log.read_text().count("set up") == 1
