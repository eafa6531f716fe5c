"""pd-decode: serve one decode node (`pd-decode --help`; node_common/launcher.py)."""

from __future__ import annotations

import sys

from decode_node.decode_server import DecodeServer
from node_common.launcher import run_node


def main(argv: list[str] | None = None) -> int:
    return run_node(DecodeServer, argv)


if __name__ == "__main__":
    sys.exit(main())
