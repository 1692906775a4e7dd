"""pytest hooks: `--rx-errors` prints the worst measured error ratio of every
kernel comparison (see checks.py)."""
import checks


def pytest_addoption(parser):
    parser.addoption("--rx-errors", action="store_true",
                     help="print max|err|/max|ref| per compared tensor")


def pytest_terminal_summary(terminalreporter, config):
    if not config.getoption("--rx-errors") or not checks.worst:
        return
    terminalreporter.section("worst max|err| / max|ref| per tensor")
    for label in sorted(checks.worst):
        terminalreporter.write_line(f"{label:40s} {checks.worst[label]:.3e}")
