"""The environment a test gives a child Python process: the repository root first on PYTHONPATH.

pytest puts the root on its own sys.path (rootdir conftest), a child `python script.py` does not:
without this a helper script that imports `tests.*` (or a module of the checkout rather than an
installed copy) fails in a fresh clone while passing wherever PYTHONPATH happens to be set.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def child_env(drop: tuple[str, ...] = (), **overrides: str) -> dict[str, str]:
    """os.environ without `drop`, with `overrides`, and REPO_ROOT prepended to PYTHONPATH."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(overrides)
    paths = [str(REPO_ROOT), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env
