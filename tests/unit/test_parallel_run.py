"""`make test`'s parallel run (tests/conftest.py under pytest-xdist, `--dist loadgroup`): tests
that share a module-scoped fixture run on one worker, which builds it once; a test whose worker
dies is reported failed once, the rest of its group runs on a new worker, and the run ends."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.child_env import child_env

RUN_TIMEOUT_S = 240.0
PROJECT = {
    "conftest.py": "from tests.conftest import (  # noqa: F401\n"
    "    pytest_collection_modifyitems, pytest_xdist_make_scheduler)\n",
    "test_groups.py": """
        import os, signal
        import pytest

        @pytest.fixture(scope="module")
        def shared():
            return os.getpid()  # the worker that built it

        def test_first(shared):
            assert shared == os.getpid()

        def test_kills_its_worker(shared):
            os.kill(os.getpid(), signal.SIGKILL)

        def test_after_the_crash(shared):
            assert shared == os.getpid()  # rebuilt on the worker it runs on

        @pytest.mark.parametrize("i", range(4))
        def test_ungrouped(i):
            pass
    """,
}


def test_a_worker_killed_mid_group_fails_its_test_once_and_the_run_ends(tmp_path) -> None:
    for name, text in PROJECT.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    argv = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q", "-rf"]
    argv += ["-p", "no:cacheprovider", str(tmp_path)]
    done = subprocess.run(
        argv, cwd=tmp_path, env=child_env(), capture_output=True, text=True,
        timeout=RUN_TIMEOUT_S,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert "1 failed, 6 passed" in out, out
    assert "crashed while running 'test_groups.py::test_kills_its_worker'" in out, out
