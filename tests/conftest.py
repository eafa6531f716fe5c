"""Session-wide test setup.

Triton reads TRITON_INTERPRET when a kernel is decorated (its module imported), and the first
module to import a kernel can be any test (the engine imports the attention kernels). On a machine
without CUDA every Triton kernel must run in the interpreter, so it is set here, before any test
module is imported.

Parallel runs (`make test`: pytest-xdist, `--dist loadgroup`): tests that share a module- or
package-scoped fixture (a cluster of node processes, a loaded model), directly or through another
test, form one group, so one worker builds each such fixture once and runs all the tests that use
it; a module may also name its group (tests/e2e/conftest.py's REAL_MODEL_CLUSTERS); every other
test goes to whichever worker is free. A test whose worker dies fails once (not again on the next
worker). The fault table (tests/e2e/faults/table.py) is started afresh and printed by the
controlling process, which is also where a serial run does it.
"""

import os
import posixpath
from pathlib import Path

import pytest
import torch

from tests.e2e.faults import table as fault_table

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_TESTS = Path(__file__).resolve().parent
_FAULTS = _TESTS / "e2e" / "faults"
_FAULT_TABLE_FRESH = pytest.StashKey[bool]()  # this run started the fault table afresh


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _may_run_fault_tests(config: pytest.Config) -> bool:
    """Whether the run's paths reach tests/e2e/faults (or lie inside it)."""
    for arg in config.args or [str(_TESTS)]:
        path = Path(config.invocation_params.dir, arg.split("::")[0]).resolve()
        if path == _FAULTS or _FAULTS.is_relative_to(path) or path.is_relative_to(_FAULTS):
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    fresh = not _is_worker(config) and _may_run_fault_tests(config)
    if fresh:
        fault_table.reset()
    config.stash[_FAULT_TABLE_FRESH] = fresh


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    rows = fault_table.read_rows() if config.stash[_FAULT_TABLE_FRESH] else []
    if rows:
        terminalreporter.section(f"fault table ({fault_table.table_path()})")
        terminalreporter.write_line(fault_table.render(rows))


def _shared_fixtures(item: pytest.Item) -> list[str]:
    """The module- and package-scoped fixture instances `item` uses, each named by where it
    lives (its module or package), its name and its parameter (one instance per value)."""
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return []
    params = getattr(getattr(item, "callspec", None), "params", {})
    names = []
    for name, defs in info.name2fixturedefs.items():
        scope = defs[-1].scope
        if scope not in ("module", "package"):
            continue
        module = item.nodeid.split("::")[0]  # the test file, relative to the rootdir
        where = module if scope == "module" else posixpath.dirname(module)
        param = f"[{params[name]}]" if name in params else ""
        names.append(f"{where}::{name}{param}")
    return names


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests that share a module- or package-scoped fixture instance, directly or through
    another test, form one xdist group (connected components of the sharing)."""
    if not config.pluginmanager.hasplugin("xdist"):
        return
    parent: dict[str, str] = {}

    def root(name: str) -> str:
        while parent.setdefault(name, name) != name:
            name = parent[name]
        return name

    uses = {item: _shared_fixtures(item) for item in items}
    for names in uses.values():
        for name in names[1:]:
            parent[root(name)] = root(names[0])
    for item, names in uses.items():
        if names and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(root(names[0])))


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadgroup`, except that a test whose worker died (the OOM killer, a crash in
    native code) is reported failed once and not run again. pytest-xdist 3.8's own loadgroup
    puts the whole group back, the test that killed its worker included: it ran again and killed
    the next worker, and after the restarts the run hung (seen on a machine short of memory)."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class CrashOnceLoadGroup(LoadGroupScheduling):
        def remove_node(self, node):  # type: ignore[no-untyped-def]
            workload = self.assigned_work.pop(node)
            pending = [(u, n) for u in workload.values() for n, done in u.items() if not done]
            if not pending:
                return None
            unit, crashed = pending[0]  # the worker runs its tests in order: this one was running
            unit[crashed] = True  # xdist reports it failed ("worker crashed while running")
            self.workqueue.update({s: u for s, u in workload.items() if not all(u.values())})
            for other in self.assigned_work:
                self._reschedule(other)
            return crashed

    return CrashOnceLoadGroup(config, log)
