"""Issue 15: a secured cluster serves. A real router and real prefill/decode nodes (in this
process, loopback) complete requests with a cluster secret (disaggregated and colocated: the
streaming Prefill and Decode calls carry their proof too), and with mutual TLS between the
router and the nodes (--tls-cert, --tls-key, --tls-ca; a throwaway CA) plus the secret; a
client without a certificate, or with one from another CA, is refused by the nodes; a router
without TLS cannot reach them."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from pdserve.config import RouterConfig, SecurityConfig
from pdserve.grpc_security import channel_credentials
from pdserve.v1 import node_pb2, node_pb2_grpc
from router.client import GenerationClient
from router.node_client import NodeClient
from router.server import RouterServer
from tests.unit.decode_node.node_harness import prompt, run, running_nodes
from tests.unit.security.tls_certs import issue, make_ca

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SecurityConfig]:
    directory = tmp_path_factory.mktemp("pki")
    ca = make_ca(directory, "cluster-ca")
    rogue_ca = make_ca(directory, "rogue-ca")

    secret = directory / "cluster-secret"
    secret.write_text("a-cluster-secret-0123456789abcdef\n")

    def config(name: str, authority, authority_name: str, **more: str) -> SecurityConfig:
        files = issue(directory, name, authority, authority_name)
        return SecurityConfig(tls_cert=files.cert, tls_key=files.key, tls_ca=files.ca, **more)

    return {  # the production shape: mutual TLS and the cluster secret
        "node": config("node", ca, "cluster-ca", cluster_secret_file=str(secret)),
        "router": config("router", ca, "cluster-ca", cluster_secret_file=str(secret)),
        "rogue": config("rogue", rogue_ca, "rogue-ca"),
        "secret only": SecurityConfig(cluster_secret_file=str(secret)),
    }


async def _one_request(nodes, security: SecurityConfig, disaggregated: bool = True) -> None:
    """A real router with `security` serves one greedy request through `nodes`."""
    router = RouterServer(
        RouterConfig(
            host="127.0.0.1", port=0, http_port=0, node_wait_s=20,
            prefill_addrs=(nodes.prefill.address,) if disaggregated else (),
            decode_addrs=(nodes.decode.address,), security=security,
        )
    )  # fmt: skip
    await router.start()
    try:
        async with GenerationClient(router.address) as client:
            result = await client.generate_all(
                prompt_token_ids=prompt(11, seed=2), temperature=0.0, max_tokens=6,
                ignore_eos=True, timeout_s=60,
            )  # fmt: skip
        assert len(result.token_ids) == 6 and result.finish_reason == "length"
        request_id = list(nodes.decode.traces)[-1]
        assert nodes.decode.traces[request_id].prefilled_locally == (not disaggregated)
    finally:
        await router.stop()


@pytest.mark.parametrize("disaggregated", [True, False], ids=["disaggregated", "colocated"])
def test_router_and_nodes_with_a_cluster_secret(
    pki: dict[str, SecurityConfig], disaggregated: bool
) -> None:
    """Every router -> node call carries its proof, the streaming ones (Prefill, Decode)
    included: grpc.aio files a client interceptor under one call shape only."""

    async def main() -> None:
        async with running_nodes("tcp", security=pki["secret only"], check_free=False) as nodes:
            await _one_request(nodes, pki["secret only"], disaggregated)

    run(main(), timeout_s=150)


async def _stats_code(address: str, credentials: grpc.ChannelCredentials | None) -> grpc.StatusCode:
    channel = (
        grpc.aio.insecure_channel(address)
        if credentials is None
        else grpc.aio.secure_channel(address, credentials)
    )
    async with channel:
        try:
            await node_pb2_grpc.NodeStub(channel).GetStats(node_pb2.GetStatsRequest(), timeout=5)
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


def test_router_and_nodes_over_mutual_tls(pki: dict[str, SecurityConfig]) -> None:
    async def main() -> None:
        # check_free=False: the harness's own stubs are plaintext, which these nodes refuse.
        async with running_nodes("tcp", security=pki["node"], check_free=False) as nodes:
            await _one_request(nodes, pki["router"])

            # Clients the nodes must refuse: no TLS, TLS without a client certificate, and a
            # certificate from another CA. The cluster's own certificate is served.
            address = nodes.decode.address
            no_client_cert = grpc.ssl_channel_credentials(
                root_certificates=Path(pki["node"].tls_ca).read_bytes()
            )
            codes = {
                "plaintext": await _stats_code(address, None),
                "no client cert": await _stats_code(address, no_client_cert),
                "rogue CA": await _stats_code(address, channel_credentials(pki["rogue"])),
            }
            assert set(codes.values()) == {grpc.StatusCode.UNAVAILABLE}, codes
            # The cluster's certificate gets through TLS; the call still needs its proof.
            no_proof = await _stats_code(address, channel_credentials(pki["router"]))
            assert no_proof == grpc.StatusCode.UNAUTHENTICATED

            # A router client without TLS never reaches a TLS node.
            plain = NodeClient(address)
            try:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await plain.node_stub.GetStats(node_pb2.GetStatsRequest(), timeout=5)
                assert error.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                await plain.close()

    run(main(), timeout_s=150)


def test_tls_needs_all_three_files() -> None:
    with pytest.raises(ValueError, match="all of --tls-cert, --tls-key and --tls-ca"):
        SecurityConfig(tls_cert="a.crt")
