"""The CLI generated from the config dataclasses: one default per knob, flags typed and checked,
pd-serve forwarding each flag (as given) to the processes it concerns."""

from __future__ import annotations

import dataclasses

import pytest

from pdserve.cli import (
    NODE,
    ROUTER,
    build_parser,
    engine_config,
    forwarded_argv,
    node_config,
    router_config,
)
from pdserve.config import (
    ENGINE_SECTIONS,
    CacheConfig,
    EngineConfig,
    NodeConfig,
    RouterConfig,
)


@pytest.mark.parametrize("cls", [*ENGINE_SECTIONS.values(), NodeConfig, RouterConfig])
def test_every_flag_defaults_to_its_fields_default(cls) -> None:
    role = "router" if cls is RouterConfig else "decode"
    extra = ["--decode", "h:1"] if role == "router" else []
    parser = build_parser(role)
    args = parser.parse_args([]) if not extra else parser.parse_known_args(extra)[0]
    flagged = [f for f in dataclasses.fields(cls) if f.metadata.get("cli")]
    assert flagged, f"{cls.__name__} has no flags"
    for f in flagged:
        assert getattr(args, f.name) == f.default, f.name


def test_node_flags_parse_into_the_configs() -> None:
    args = build_parser("prefill").parse_args(
        ["--model", "synthetic:llama3-8b", "--kv-cache-memory", "2GiB", "--no-prefix-caching",
         "--num-kv-blocks", "64", "--max-num-seqs", "8", "--kv-transport", "tcp",
         "--transfer-timeout-s", "4", "--port", "7001"]
    )  # fmt: skip
    engine = engine_config(args, prefill_only=True)
    assert engine.model.model == "synthetic:llama3-8b"
    assert (engine.cache.kv_cache_memory, engine.cache.num_blocks) == (2 << 30, 64)
    assert engine.cache.enable_prefix_caching is False
    assert (engine.scheduler.max_num_seqs, engine.scheduler.prefill_only) == (8, True)
    node = node_config(args)
    assert (node.kv_transport, node.transfer_timeout_s, node.port) == ("tcp", 4.0, 7001)


def test_bad_values_name_the_flag(capsys) -> None:
    parser = build_parser("decode")
    with pytest.raises(SystemExit):
        parser.parse_args(["--kv-cache-memory", "lots"])
    assert "--kv-cache-memory: not a size: 'lots'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["--dtype", "int3"])
    assert "invalid choice: 'int3'" in capsys.readouterr().err


def test_router_flags_parse_into_a_router_config() -> None:
    args = build_parser("router").parse_args(
        ["--policy", "prefix_aware", "--local-prefill-max-tokens", "64", "--port", "0"]
    )
    config = router_config(args, decode_addrs=("127.0.0.1:7001",))
    assert (config.policy, config.local_prefill_max_tokens, config.port) == ("prefix_aware", 64, 0)
    assert config.decode_addrs == ("127.0.0.1:7001",)


def test_pd_serve_forwards_each_flag_as_given_to_whom_it_concerns() -> None:
    parser = build_parser("serve")
    parser.add_argument("--prefill", type=int)  # pd-serve's own flags are not forwarded
    argv = [
        "--prefill", "2", "--model", "m", "--policy", "prefix_aware", "--transfer-timeout-s",
        "5", "--host", "0.0.0.0", "--no-prefix-caching", "--kv-cache-memory=1GiB",
        "--registry", "redis://h:1/0",
    ]  # fmt: skip
    parser.parse_args(argv)
    assert forwarded_argv(parser, argv, NODE) == [
        "--model", "m", "--transfer-timeout-s", "5", "--host", "0.0.0.0", "--no-prefix-caching",
        "--kv-cache-memory=1GiB", "--registry", "redis://h:1/0",
    ]  # fmt: skip
    assert forwarded_argv(parser, argv, ROUTER) == [
        "--policy", "prefix_aware", "--transfer-timeout-s", "5", "--host", "0.0.0.0",
        "--registry", "redis://h:1/0",
    ]  # fmt: skip


def test_pd_serve_has_no_per_node_addresses() -> None:
    options = build_parser("serve").targets
    assert "--kv-port" not in options and "--advertise-host" not in options
    assert "--kv-port" in build_parser("decode").targets


def test_engine_config_takes_any_section_field_by_name() -> None:
    config = EngineConfig.from_kwargs(model="m", gpu_memory_utilization=0.5, max_num_seqs=4)
    assert config.cache == dataclasses.replace(CacheConfig(), gpu_memory_utilization=0.5)
    assert (config.model.model, config.scheduler.max_num_seqs) == ("m", 4)
    with pytest.raises(TypeError, match="unknown engine setting 'gpu_util'"):
        EngineConfig.from_kwargs(gpu_util=0.5)
