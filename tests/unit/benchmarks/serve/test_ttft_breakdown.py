"""pd-bench ttft --breakdown: the rows of the TTFT chain add up to the client's TTFT, and a
node's marks count only when they are the measured request's."""

from __future__ import annotations

import pytest

from benchmarks.serve.ttft_breakdown import (
    LEG,
    TTFT_ROWS,
    RequestTimes,
    node_marks,
    segments,
    table,
)
from pdserve.v1 import node_pb2


def _pd_request() -> RequestTimes:
    router = {"received": 1.0, "processed": 1.001, "routed": 1.0015, "decode_sent": 1.002,
              "prefill_sent": 1.0025, "ticket": 1.004, "attached": 1.005,
              "prefill_first_token": 1.050, "decode_first_token": 1.060,
              "first_token_out": 1.0505}  # fmt: skip
    prefill = {"rpc": 1.003, "ticket": 1.0045, "computing": 1.006, "first_token": 1.049}
    decode = {"rpc": 1.0028, "ticket": 1.0035, "kv_done": 1.055}
    return RequestTimes(0.9995, 1.051, router, prefill, decode)


def test_the_ttft_chain_adds_up_to_the_clients_ttft() -> None:
    rows = segments(_pd_request())
    top = [name for name in TTFT_ROWS if not name.startswith("  ") and name != "TTFT (client)"]
    assert sum(rows[name] for name in top) == pytest.approx(rows["TTFT (client)"])
    legs = [name for name in TTFT_ROWS if name.startswith("  ")]
    assert sum(rows[name] for name in legs) == pytest.approx(rows[LEG])
    assert rows["  P: prefill"] == pytest.approx(43.0)
    assert rows["  router -> P: AttachTicket"] == pytest.approx(0.5)
    assert rows["  D: KV + first token in, ms after P's first token"] == pytest.approx(6.0)


def test_a_colocated_request_has_one_node_row_and_the_table_both_columns() -> None:
    router = {"received": 2.0, "processed": 2.001, "routed": 2.002, "decode_sent": 2.003,
              "decode_first_token": 2.030, "first_token_out": 2.031}  # fmt: skip
    colocated = RequestTimes(1.999, 2.032, router)
    rows = segments(colocated)
    assert rows[LEG] == pytest.approx(27.0) and "  P: queue" not in rows

    lines = table([colocated], [_pd_request()])
    ttft = next(line for line in lines if line.startswith("TTFT (client)"))
    assert ttft.split()[-3:] == ["33.000", "51.500", "18.500"]
    queue = next(line for line in lines if line.startswith("  P: queue"))
    assert queue.split()[-3:] == ["-", "3.000", "-"]


def test_node_marks_are_the_measured_requests_only() -> None:
    timeline = node_pb2.LayerTimeline(request_id="ttft8-3.abc", marks_s={"rpc": 5.0})
    assert node_marks(timeline, "ttft8-3") == {"rpc": 5.0}
    assert node_marks(timeline, "ttft8-30") == {}
    assert node_marks(timeline, "ttft8") == {}
