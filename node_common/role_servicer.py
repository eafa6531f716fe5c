"""`RoleServicer`: what the prefill and decode servicers both hold and count, and how their
calls end.

RoleServicer(engine, manager, transfer_timeout_s, metrics, counters)
                          built by the role's `NodeBase.make_servicer`; `counters` feed the
                          node's load report (NodeStats)
@ends_with_status         a streaming handler that ends in an error it did not map still ends
                          with a status a client can act on, never UNKNOWN: the engine stopped
                          ──► UNAVAILABLE; the engine refused the request (a migrated output or
                          a first token its grammar refuses) ──► INVALID_ARGUMENT; anything
                          else (a bug) ──► INTERNAL, logged with its traceback
abort_call(context, ...)  `context.abort`, typed as never returning
"""

from __future__ import annotations

import functools
import logging
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc

from cache_transfer import KVTransferManager
from engine.async_engine import AsyncEngine, EngineDeadError
from node_common.node_metrics import NodeMetrics
from pdserve.errors import InvalidRequestError

logger = logging.getLogger(__name__)

S = TypeVar("S")
R = TypeVar("R")
M = TypeVar("M")


@dataclass
class NodeCounters:
    """Since the node started."""

    num_finished_requests: int = 0  # requests whose output (first token, or stream) went out
    num_queued_prefill_tokens: int = 0  # prompt tokens of prefills with no first token yet


class RoleServicer:
    """Base of a role's gRPC servicer."""

    def __init__(
        self,
        engine: AsyncEngine,
        manager: KVTransferManager,
        transfer_timeout_s: float,
        metrics: NodeMetrics,
        counters: NodeCounters,
    ) -> None:
        self.counters = counters
        self._engine = engine
        self._manager = manager
        # A hand-off starts with its prefill (within this) and ends within this of its start.
        self._transfer_timeout_s = transfer_timeout_s
        self._metrics = metrics


async def abort_call(
    context: grpc.aio.ServicerContext, code: grpc.StatusCode, details: str
) -> NoReturn:
    """End the call with `code` (raises, as `context.abort` does)."""
    await context.abort(code, details)
    raise AssertionError("context.abort returned")  # it raises AbortError


def ends_with_status(
    handler: Callable[[S, R, Any], AsyncGenerator[M, None]],
) -> Callable[[S, R, Any], AsyncGenerator[M, None]]:
    """Wrap a server-streaming handler so that no error leaves it unmapped (see the module
    docstring). Its cleanup runs when its call ends, as without the wrapper."""

    @functools.wraps(handler)
    async def ended_with_status(
        self: S, request: R, context: grpc.aio.ServicerContext
    ) -> AsyncGenerator[M, None]:
        messages = handler(self, request, context)
        try:
            async for message in messages:
                yield message
        except grpc.aio.AbortError:  # the handler chose its status
            raise
        except EngineDeadError as error:
            await abort_call(context, grpc.StatusCode.UNAVAILABLE, f"this node's {error}")
        except InvalidRequestError as error:  # the engine refused the request's add
            await abort_call(context, grpc.StatusCode.INVALID_ARGUMENT, str(error))
        except Exception as error:
            logger.exception("%s failed unexpectedly", handler.__qualname__)
            await abort_call(  # the details stay in this node's log
                context, grpc.StatusCode.INTERNAL,
                f"internal error on the node ({type(error).__name__}); see the node's log",
            )  # fmt: skip
        finally:
            await messages.aclose()

    return ended_with_status
