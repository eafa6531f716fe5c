"""`RankLink`: the channel between a tensor-parallel node's rank 0 and one of its other ranks.

```
worker rank   serve_link(handler) ─► a Unix socket in a fresh 0700 folder, and a random key;
              both travel to rank 0 in the rank's worker_init result (the engine's pipe)
rank 0        connect_link(path, key, handler): the key is the first frame (anything else
              closes the connection); from then on, both ways:
              call(message) ─► the other end's handler(message) ─► its answer (or its error)
              note(message) ─► the other end's handler(message), nobody waits
a frame       4-byte length (checked against MAX_FRAME_BYTES before reading) + pickle
EOF           the other end is gone: `closed` is set, pending calls fail with LinkClosed
```

Only the two processes of one node speak on it (the socket's folder is private, the key is
checked first), so its frames are pickled messages of node_common/tp/rank_messages.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import pickle
import secrets
import shutil
import struct
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

MAX_FRAME_BYTES = 16 << 20  # a ticket of a long prompt is a few hundred KiB
KEY_BYTES = 32
_HEADER = struct.Struct("!I")

Handler = Callable[[Any], Awaitable[Any]]


class LinkClosed(ConnectionError):
    """The other end of a rank link is gone (or never answered in time)."""


class RankLink:
    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handler: Handler,
        name: str,
    ) -> None:  # fmt: skip
        self.name = name
        self.closed = asyncio.Event()
        self._reader, self._writer = reader, writer
        self._handler = handler
        self._ids = itertools.count(1)
        self._calls: dict[int, asyncio.Future[Any]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._reading = asyncio.get_running_loop().create_task(self._read_loop())

    async def call(self, message: Any, timeout_s: float) -> Any:
        """The other end's answer to `message`; LinkClosed when it is gone or silent for
        `timeout_s`; its handler's error, raised here, as RuntimeError."""
        if self.closed.is_set():
            raise LinkClosed(f"{self.name} is closed")
        call_id = next(self._ids)
        answer: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls[call_id] = answer
        try:
            self._write(("call", call_id, message))
            async with asyncio.timeout(timeout_s):
                return await answer
        except TimeoutError:
            raise LinkClosed(f"{self.name} did not answer within {timeout_s:g} s") from None
        finally:
            self._calls.pop(call_id, None)

    def note(self, message: Any) -> None:
        """Send `message`, nobody waits (dropped, logged, once the link is closed)."""
        if self.closed.is_set():
            logger.warning("%s is closed: dropped %r", self.name, message)
            return
        self._write(("note", 0, message))

    async def close(self) -> None:
        self._reading.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reading
        self._closed()
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError):
            await self._writer.wait_closed()

    def _write(self, frame: tuple[str, int, Any]) -> None:
        data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_FRAME_BYTES:
            raise ValueError(f"a rank link frame of {len(data)} bytes exceeds {MAX_FRAME_BYTES}")
        self._writer.write(_HEADER.pack(len(data)) + data)

    async def _read_loop(self) -> None:
        try:
            while True:
                kind, call_id, body = await _read_frame(self._reader)
                if kind in ("reply", "error"):
                    self._settle(call_id, kind, body)
                else:
                    self._spawn(self._answer(kind, call_id, body))
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError) as error:
            if not isinstance(error, asyncio.IncompleteReadError):
                logger.warning("%s: %r", self.name, error)
        finally:
            self._closed()

    def _settle(self, call_id: int, kind: str, body: Any) -> None:
        answer = self._calls.get(call_id)
        if answer is None or answer.done():
            return  # its caller gave up
        if kind == "reply":
            answer.set_result(body)
        else:
            answer.set_exception(RuntimeError(f"{self.name}: {body}"))

    async def _answer(self, kind: str, call_id: int, body: Any) -> None:
        try:
            result = await self._handler(body)
        except Exception as error:  # noqa: BLE001 - the caller gets it
            logger.exception("%s: handling %r failed", self.name, body)
            if kind == "call" and not self.closed.is_set():
                self._write(("error", call_id, repr(error)))
            return
        if kind == "call" and not self.closed.is_set():
            self._write(("reply", call_id, result))

    def _spawn(self, coro: Awaitable[None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _closed(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for answer in self._calls.values():
            if not answer.done():
                answer.set_exception(LinkClosed(f"{self.name} closed"))


async def _read_frame(reader: asyncio.StreamReader) -> tuple[str, int, Any]:
    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    if size > MAX_FRAME_BYTES:
        raise ValueError(f"a rank link frame of {size} bytes exceeds {MAX_FRAME_BYTES}")
    frame = pickle.loads(await reader.readexactly(size))  # noqa: S301 - the key was checked
    if not (isinstance(frame, tuple) and len(frame) == 3):
        raise ValueError("a malformed rank link frame")
    return frame


class LinkServer:
    """A worker rank's end: one Unix socket that takes rank 0 (the first connection whose
    first bytes are the key); `link` once it connected."""

    def __init__(self, handler: Handler, name: str) -> None:
        self.key = secrets.token_bytes(KEY_BYTES)
        self.folder = Path(tempfile.mkdtemp(prefix="pdserve-rank-"))  # 0700
        self.path = str(self.folder / "link.sock")
        self.link: RankLink | None = None
        self.connected = asyncio.Event()
        self._handler = handler
        self._name = name
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._accept, path=self.path)
        os.chmod(self.path, 0o600)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            key = await asyncio.wait_for(reader.readexactly(KEY_BYTES), 10.0)
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            writer.close()
            return
        if self.link is not None or not hmac.compare_digest(key, self.key):
            logger.warning("%s: refused a connection (a second one, or a wrong key)", self._name)
            writer.close()
            return
        self.link = RankLink(reader, writer, self._handler, self._name)
        self.connected.set()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        if self.link is not None:
            await self.link.close()
        shutil.rmtree(self.folder, ignore_errors=True)


async def connect_link(path: str, key: bytes, handler: Handler, name: str) -> RankLink:
    """Rank 0's end of a worker rank's link (LinkClosed when it cannot connect)."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(path), 10.0)
    except (TimeoutError, OSError) as error:
        raise LinkClosed(f"{name}: cannot connect to {path}: {error}") from None
    writer.write(key)
    return RankLink(reader, writer, handler, name)
