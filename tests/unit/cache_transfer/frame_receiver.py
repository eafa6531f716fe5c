"""A decode-side KV transfer manager (tcp) in its own process, for the oversized-frame test.

python frame_receiver.py    prints "ADDRESS PID", then serves until stdin closes;
                            each line on stdin: "check" -> prints "alive"
"""

from __future__ import annotations

import asyncio
import os
import sys

from transfer_helpers import make_layout, sentinel_caches

from cache_transfer import KVTransferManager, make_transport


async def main() -> None:
    layout = make_layout()
    manager = KVTransferManager(make_transport("tcp"), layout, sentinel_caches(layout, 64))
    print(manager.address, os.getpid(), manager.max_frame_bytes, flush=True)
    loop = asyncio.get_running_loop()
    while line := await loop.run_in_executor(None, sys.stdin.readline):
        if line.strip() == "check":
            print("alive", flush=True)
    await manager.close()


if __name__ == "__main__":
    asyncio.run(main())
