"""pytest hooks: `--rx-errors` prints the worst measured error ratio of every
kernel comparison (see checks.py); shared fixtures."""
import pytest

import rwkvx_c as rx

import checks


@pytest.fixture
def restore_threads():
    """Gives back the thread count a test changes."""
    n = rx.get_num_threads()
    yield
    rx.set_num_threads(n)


@pytest.fixture
def small_m():
    """Gives back the small-M bound a test changes (both GEMMs')."""
    m = rx._core._sgemm_small_m(0)
    rx._core._sgemm_small_m(m)
    yield m
    rx._core._sgemm_small_m(m)


def pytest_addoption(parser):
    parser.addoption("--rx-errors", action="store_true",
                     help="print max|err|/max|ref| per compared tensor")


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--rx-errors") or not checks.worst:
        return
    terminalreporter.section("worst max|err| / max|ref| per tensor")
    for label in sorted(checks.worst):
        terminalreporter.write_line(f"{label:40s} {checks.worst[label]:.3e}")
