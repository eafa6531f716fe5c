"""pd-prefill: serve one prefill node (`pd-prefill --help`; node_common/launcher.py)."""

from __future__ import annotations

import sys

from node_common.launcher import run_node
from prefill_node.prefill_server import PrefillServer


def main(argv: list[str] | None = None) -> int:
    return run_node(PrefillServer, argv)


if __name__ == "__main__":
    sys.exit(main())
