"""pd-router under cProfile, timed by the main thread's CPU clock (`time.thread_time`): where
the event loop's CPU goes, unmoved by a loaded machine's preemptions (a wall-clock profile
charges them to whatever function was running).

    python -m benchmarks.router.profiled_router STATS_PATH [pd-router flags ...]

The stats are written to STATS_PATH when the router stops (SIGINT/SIGTERM).
"""

from __future__ import annotations

import cProfile
import sys
import time

from router import cli


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: profiled_router STATS_PATH [pd-router flags ...]", file=sys.stderr)
        return 2
    profile = cProfile.Profile(time.thread_time)
    try:
        code = profile.runcall(cli.main, argv[1:])
    finally:
        profile.dump_stats(argv[0])
    return code


if __name__ == "__main__":
    sys.exit(main())
