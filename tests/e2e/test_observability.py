"""What an operator sees of a real CPU pd-serve (1P1D): Prometheus metrics on the router's
HTTP port and on both nodes' --metrics-port after known traffic, and one request's log lines
across the router and both node processes."""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from router.client import GenerationClient
from tests.e2e.conftest import MODEL, REAL_MODEL_CLUSTERS
from tests.e2e.observe import process_lines

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300), REAL_MODEL_CLUSTERS]

TIMEOUT_S = 120.0
LOG_WAIT_S = 10.0  # node lines may be written just after the router's answer went out
LONG_PROMPT = (
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden press adapted from wine "
    "making. Within decades printing shops had spread across Europe, and"
)  # several full KV blocks: its second run finds them in the prefill node's prefix cache
SHORT_PROMPT = "Hi"  # one token: the local-prefill route (conftest.HTTP_LOCAL_PREFILL_MAX_TOKENS)

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(url: str) -> tuple[Samples, dict[str, str]]:
    """Every sample (name, sorted labels) -> value, and each family's name -> type."""
    text = httpx.get(url, timeout=10).text
    samples: Samples = {}
    types = {}
    for family in text_string_to_metric_families(text):
        types[family.name] = family.type
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples, types


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


class Scrapes:
    """Before/after scrapes of the router and both nodes: deltas of what the test sent."""

    def __init__(self, cluster) -> None:
        self.urls = {"router": f"{cluster.http_url}/metrics", **cluster.metrics_urls}
        self.before = {name: scrape(url)[0] for name, url in self.urls.items()}
        self.after: dict[str, Samples] = {}
        self.types: dict[str, dict[str, str]] = {}

    def take(self) -> None:
        for name, url in self.urls.items():
            self.after[name], self.types[name] = scrape(url)

    def delta(self, process: str, name: str, **labels: str) -> float:
        return value(self.after[process], name, **labels) - value(
            self.before[process], name, **labels
        )

    def now(self, process: str, name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        assert key in self.after[process], f"{process}: no sample {key}"
        return self.after[process][key]


@dataclass
class Traffic:
    scrapes: Scrapes
    served: list  # the completions served (finish length, length, length, stop)
    num_disaggregated: int  # how many of them went through the prefill node


@pytest.fixture(scope="module")
def traffic(cluster_http) -> Traffic:
    """Known requests between two scrapes of the router's and both nodes' /metrics."""
    assert set(cluster_http.metrics_urls) == {"prefill-0", "decode-0"}
    scrapes = Scrapes(cluster_http)
    client = openai.OpenAI(base_url=f"{cluster_http.http_url}/v1", api_key="unused",
                           timeout=TIMEOUT_S, max_retries=0)  # fmt: skip
    with client:
        length = [  # disaggregated, then the same prompt again (prefix-cache hits), then local
            client.completions.create(
                model=MODEL,
                prompt=prompt,
                max_tokens=6,
                temperature=0,
                extra_body={"ignore_eos": True},  # a vLLM extra: every request runs 6 tokens
            )  # fmt: skip
            for prompt in (LONG_PROMPT, LONG_PROMPT, SHORT_PROMPT)
        ]
        full = length[0].choices[0].text
        # a stop string in the second half of that text; the request may run past it
        cut = next(k for k in range(len(full) // 2, len(full) - 1)
                   if full[k:k + 2].strip() and full.find(full[k:k + 2]) == k)  # fmt: skip
        stopped = client.completions.create(model=MODEL, prompt=LONG_PROMPT, max_tokens=12,
                                            temperature=0, stop=[full[cut:cut + 2]])  # fmt: skip
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == full[:cut]
        with pytest.raises(openai.BadRequestError):
            client.completions.create(model=MODEL, prompt=LONG_PROMPT, temperature=-1)
    served = [*length, stopped]
    num_disaggregated = 3  # the long prompts
    cluster_http.wait_all_blocks_free(timeout_s=10)
    scrapes.take()
    return Traffic(scrapes, served, num_disaggregated)


def test_router_metrics(traffic):
    scrapes, served = traffic.scrapes, traffic.served

    # router: requests by status and finish reason, latency histograms, tokens, routes
    d = scrapes.delta
    assert d("router", "pdserve_requests_total", api="http", status="OK",
             finish_reason="length") == 3  # fmt: skip
    assert d("router", "pdserve_requests_total", api="http", status="OK",
             finish_reason="stop") == 1  # fmt: skip
    assert d("router", "pdserve_requests_total", api="http", status="INVALID_ARGUMENT",
             finish_reason="") == 1  # fmt: skip
    for histogram in ("pdserve_time_to_first_token_seconds", "pdserve_e2e_request_latency_seconds",
                      "pdserve_time_per_output_token_seconds"):  # fmt: skip
        assert scrapes.types["router"][histogram] == "histogram"
        assert d("router", f"{histogram}_count") == len(served), histogram
        assert d("router", f"{histogram}_sum") > 0, histogram
    completion_tokens = sum(r.usage.completion_tokens for r in served)
    prompt_tokens = sum(r.usage.prompt_tokens for r in served)
    assert d("router", "pdserve_generation_tokens_total") == completion_tokens
    assert d("router", "pdserve_prompt_tokens_total") == prompt_tokens
    # ITL: one sample per token after each request's first chunk
    assert 0 < d("router", "pdserve_inter_token_latency_seconds_count") < completion_tokens
    assert scrapes.now("router", "pdserve_requests_running") == 0
    assert d("router", "pdserve_routes_total", kind="disaggregated",
             reason="") == traffic.num_disaggregated  # fmt: skip
    assert d("router", "pdserve_routes_total", kind="local", reason="short_prompt") == 1
    assert d("router", "pdserve_prefix_cache_hit_tokens_total") > 0
    assert scrapes.now("router", "pdserve_retries_total") == 0
    assert scrapes.now("router", "pdserve_prefill_failures_total") == 0


def test_node_metrics(traffic):
    scrapes, served, num_disaggregated = traffic.scrapes, traffic.served, traffic.num_disaggregated
    d = scrapes.delta
    # load gauges, KV pool, finished requests, prefix cache, local prefills, transfers
    for node in ("prefill-0", "decode-0"):
        assert scrapes.now(node, "pdserve_node_requests_running") == 0
        assert scrapes.now(node, "pdserve_node_requests_waiting") == 0
        total = scrapes.now(node, "pdserve_node_kv_blocks")
        assert total > 0 and scrapes.now(node, "pdserve_node_kv_blocks_free") == total
        assert scrapes.now(node, "pdserve_node_kv_cache_usage_ratio") == 0
    # the stop-string request ends at the router, which aborts it on the decode node: counted
    # there unless the router's cancel of the call beat the abort's last chunk
    assert d("decode-0", "pdserve_node_requests_finished_total") in (len(served) - 1, len(served))
    assert d("prefill-0", "pdserve_node_requests_finished_total") == num_disaggregated
    assert d("prefill-0", "pdserve_node_prefix_cache_hit_tokens_total") > 0  # the repeated prompt
    # the host KV tier (--kv-offload-memory): the prefill node's cached prompts were demoted;
    # the decode node's received KV is never cached without a cluster secret, so never demoted
    for node, demoted in (("prefill-0", True), ("decode-0", False)):
        host_blocks = scrapes.now(node, "pdserve_node_host_kv_blocks")
        free_host_blocks = scrapes.now(node, "pdserve_node_host_kv_blocks_free")
        assert host_blocks > 0 and (free_host_blocks < host_blocks) == demoted
        assert (d(node, "pdserve_node_kv_offload_bytes_total") > 0) == demoted
        # the device pool kept every prompt: no hit had to come from the host tier
        assert d(node, "pdserve_node_prefix_cache_host_hit_tokens_total") == 0
        assert d(node, "pdserve_node_kv_promotion_bytes_total") == 0
    assert d("decode-0", "pdserve_node_local_prefills_total") == 1
    assert scrapes.now("decode-0", "pdserve_node_kv_transfer_fallbacks_total") == 0
    for node, direction in (("prefill-0", "sent"), ("decode-0", "received")):
        assert d(node, "pdserve_node_kv_transfer_bytes_total", direction=direction) > 0
        assert d(node, "pdserve_node_kv_transfers_total", direction=direction,
                 result="ok") == num_disaggregated  # fmt: skip
        assert scrapes.now(node, "pdserve_node_kv_transfers_total", direction=direction,
                           result="failed") == 0  # fmt: skip
        assert d(node, "pdserve_node_kv_transfer_duration_seconds_count",
                 direction=direction) == num_disaggregated  # fmt: skip
    sent = d("prefill-0", "pdserve_node_kv_transfer_bytes_total", direction="sent")
    assert d("decode-0", "pdserve_node_kv_transfer_bytes_total", direction="received") == sent


def lines_for(cluster, process: str, request_id: str) -> list[str]:
    """`process`'s log lines about the request, waiting (bounded) for at least one."""
    deadline = time.monotonic() + LOG_WAIT_S
    while not (lines := process_lines(cluster, process, f"[req={request_id}")) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.05)
    return lines


def test_one_request_logs_across_router_and_nodes(cluster_http):
    client_id = f"trace-{uuid.uuid4().hex[:8]}"

    async def main():
        async with GenerationClient(cluster_http.router) as client:
            return await client.generate_all(LONG_PROMPT, request_id=client_id, temperature=0.0,
                                             max_tokens=5, timeout_s=TIMEOUT_S)  # fmt: skip

    result = asyncio.run(asyncio.wait_for(main(), TIMEOUT_S))
    # the internal id every process logs: the client's id, a dot, a unique suffix
    internal_prefix = f"{client_id}."
    router_lines = lines_for(cluster_http, "router", internal_prefix)
    access = [line for line in router_lines if "router.access" in line]
    assert len(access) == 1, router_lines
    (line,) = access
    prefill, decode = cluster_http.nodes["prefill-0"], cluster_http.nodes["decode-0"]
    for part in (f"route=P={prefill} D={decode}", f"prompt_tokens={result.usage.prompt_tokens}",
                 f"completion_tokens={len(result.token_ids)}", "ttft=", "total=", "status=OK",
                 f"finish={result.finish_reason}"):  # fmt: skip
        assert part in line, (part, line)
    request_id = line.split("[req=", 1)[1].split("]", 1)[0]
    assert request_id.startswith(internal_prefix)
    prefill_lines = lines_for(cluster_http, "prefill-0", request_id)
    decode_lines = lines_for(cluster_http, "decode-0", request_id)
    assert any("prefill done" in x and "KV hand-off ok" in x for x in prefill_lines), prefill_lines
    assert any("decode finished" in x for x in decode_lines), decode_lines
    # and no other request's lines carry this client's id
    assert all(request_id in x for x in process_lines(cluster_http, "router", f"[req={client_id}"))
