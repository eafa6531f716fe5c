"""The one CLI builder every launcher shares (pd-router, pd-prefill, pd-decode, pd-serve).

```
build_parser(role)            common flags (--host, --port, --log-level, registry) + the role's:
                                router: RouterConfig's knobs
                                prefill/decode: EngineConfig's and NodeConfig's knobs
                                serve: both (pd-serve forwards each flag to whom it concerns)
add_config_flags(group, Cls)  one flag per knob of a config dataclass (pdserve.config.knob):
                              name, default, help, type and choices come from the field
config_from_args(Cls, args)   the parsed flags back into the dataclass
forwarded_argv(parser, argv)  pd-serve: the argv tokens a child process of `target` gets,
                              verbatim, so a default is never restated
```

Torch-free, so the router starts fast.
"""

from __future__ import annotations

import argparse
import builtins
import dataclasses
import types
import typing
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from pdserve.config import (
    DEFAULT_HOST,
    DEFAULT_ROUTER_PORT,
    ENGINE_SECTIONS,
    EngineConfig,
    NodeConfig,
    RegistryConfig,
    RouterConfig,
    SecurityConfig,
)
from pdserve.logs import LOG_FORMATS, configure_logging

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

ConfigT = TypeVar("ConfigT", bound="DataclassInstance")

ROLES = ("router", "prefill", "decode", "serve")
ROUTER, NODE = "router", "node"  # forwarding targets of pd-serve's flags
LOG_LEVELS = ("debug", "info", "warning", "error")


class ArgumentParser(argparse.ArgumentParser):
    """argparse that remembers, per option, which processes pd-serve forwards it to."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(allow_abbrev=False, **kwargs)  # forwarding needs exact names
        self.targets: dict[str, set[str]] = {}  # "--flag" -> {"router", "node"}

    def add_forwarded(self, group: Any, *flags: str, targets: Iterable[str], **kwargs: Any) -> None:
        """`group.add_argument(*flags, **kwargs)`, noting where pd-serve forwards it. A flag
        that exists already (the same knob in two configs) only gains targets."""
        if flags[0] in self.targets:
            self.targets[flags[0]].update(targets)
            return
        group.add_argument(*flags, **kwargs)
        for flag in flags:
            self.targets[flag] = set(targets)


def build_parser(role: str, description: str | None = None) -> ArgumentParser:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; expected one of {ROLES}")
    parser = ArgumentParser(prog=f"pd-{role}", description=description)
    both = (ROUTER, NODE)
    default_port = DEFAULT_ROUTER_PORT if role in ("router", "serve") else 0
    parser.add_forwarded(parser, "--host", targets=both, default=DEFAULT_HOST,
                         help=f"address to listen on (default: {DEFAULT_HOST})")  # fmt: skip
    parser.add_forwarded(
        parser, "--port", targets=(ROUTER,), type=int, default=default_port,
        help=f"gRPC port (default {default_port}{'' if default_port else ': a free one'})",
    )  # fmt: skip
    parser.add_forwarded(parser, "--log-level", targets=both, default="info", choices=LOG_LEVELS,
                         help="(default: info)")  # fmt: skip
    parser.add_forwarded(
        parser, "--log-format", targets=both, default="text", choices=LOG_FORMATS,
        help="text: one line per record, [req=ID] on lines about a request; json: one JSON "
        "object per line (ts, level, role, logger, request_id, msg) (default: text)",
    )  # fmt: skip
    _add_registry_flags(parser)
    add_config_flags(parser, parser.add_argument_group("security"), SecurityConfig, both)
    if role in ("router", "serve"):
        add_config_flags(parser, parser.add_argument_group("routing"), RouterConfig, (ROUTER,))
    if role in ("prefill", "decode", "serve"):
        for section, cls in ENGINE_SECTIONS.items():
            add_config_flags(parser, parser.add_argument_group(f"engine: {section}"), cls, (NODE,))
        group = parser.add_argument_group("node and KV transfer")
        # pd-serve picks every node's ports and addresses itself
        exclude = ("kv_port", "advertise_host", "grace_s") if role == "serve" else ()
        add_config_flags(parser, group, NodeConfig, (NODE,), exclude=exclude)
    return parser


def _add_registry_flags(parser: ArgumentParser) -> None:
    group = parser.add_argument_group("service discovery")
    both = (ROUTER, NODE)
    parser.add_forwarded(
        group, "--registry", targets=both, default=None, metavar="URL",
        help="Redis registry, e.g. redis://127.0.0.1:6379/0: nodes register there (with a TTL "
        "heartbeat) and routers discover them (default: none; give the router node addresses)",
    )  # fmt: skip
    parser.add_forwarded(
        group, "--registry-heartbeat-s", targets=both, type=float,
        default=RegistryConfig.heartbeat_s,
        help="how often nodes refresh their record and routers resync their view (default: "
        f"{RegistryConfig.heartbeat_s})",
    )  # fmt: skip
    parser.add_forwarded(
        group, "--registry-ttl-s", targets=both, type=float, default=RegistryConfig.ttl_s,
        help="a node record not refreshed for this long expires (about 3 heartbeats) "
        f"(default: {RegistryConfig.ttl_s})",
    )  # fmt: skip


def add_config_flags(
    parser: ArgumentParser,
    group: Any,
    cls: type,
    targets: Sequence[str],
    exclude: Sequence[str] = (),
) -> None:
    """One flag per `knob` of dataclass `cls` (fields with cli=False or in `exclude` skipped)."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta.get("cli", False) or f.name in exclude:
            continue
        value_type = _value_type(f.type)
        # a switch that is on by default is turned off: --no-NAME
        off = "no-" if value_type is bool and f.default else ""
        flag = meta["flag"] or "--" + off + f.name.replace("_", "-")
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
        if value_type is bool:
            kwargs["action"] = "store_false" if f.default else "store_true"
        else:
            kwargs["type"] = _argparse_type(meta["parse"] or value_type, flag)
            if meta["choices"]:
                kwargs["choices"] = meta["choices"]
            if "default" not in kwargs["help"]:
                kwargs["help"] += f" (default: {'none' if f.default is None else f.default})"
        parser.add_forwarded(group, flag, targets=targets, **kwargs)


def _value_type(annotation: str | type) -> type:
    """ "int | None" -> int; "str" -> str (a knob with a flag has a builtin type)."""
    hint = eval(annotation, vars(builtins)) if isinstance(annotation, str) else annotation
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        (hint,) = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return hint


def _argparse_type(parse: Any, flag: str) -> Any:
    """argparse reports ArgumentTypeError messages as they are; ValueError only generically."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as error:
            raise argparse.ArgumentTypeError(f"{flag}: {error}") from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def config_from_args(cls: type[ConfigT], args: argparse.Namespace, **overrides: Any) -> ConfigT:
    """`cls` from the parsed flags of its knobs (fields without a flag keep their defaults
    unless given in `overrides`). Raises ValueError from the dataclass's own checks."""
    values = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(cls)
        if f.metadata.get("cli") and hasattr(args, f.name)
    }
    return cls(**{**values, **overrides})


def node_config(args: argparse.Namespace) -> NodeConfig:
    """A node's flags (common ones included) as a NodeConfig; ValueError when bad."""
    return config_from_args(
        NodeConfig, args, host=args.host, port=args.port, registry=registry_config(args),
        security=config_from_args(SecurityConfig, args),
    )  # fmt: skip


def router_config(args: argparse.Namespace, **addresses: Any) -> RouterConfig:
    """The router's flags as a RouterConfig, with `prefill_addrs` / `decode_addrs`."""
    return config_from_args(
        RouterConfig, args, host=args.host, port=args.port, registry=registry_config(args),
        security=config_from_args(SecurityConfig, args), **addresses,
    )  # fmt: skip


def engine_config(args: argparse.Namespace, **scheduler_overrides: Any) -> EngineConfig:
    """The node flags as an EngineConfig (e.g. `prefill_only=True` for the prefill role)."""
    sections = {name: config_from_args(cls, args) for name, cls in ENGINE_SECTIONS.items()}
    if scheduler_overrides:
        sections["scheduler"] = dataclasses.replace(sections["scheduler"], **scheduler_overrides)
    return EngineConfig(**sections)


def registry_config(args: argparse.Namespace) -> RegistryConfig | None:
    """The registry flags as a RegistryConfig (None without --registry); ValueError when bad."""
    if args.registry is None:
        return None
    return RegistryConfig(
        url=args.registry, heartbeat_s=args.registry_heartbeat_s, ttl_s=args.registry_ttl_s
    )


def forwarded_argv(parser: ArgumentParser, argv: Sequence[str], target: str) -> list[str]:
    """The tokens of `argv` (already parsed by `parser`) whose flags go to `target`, as given."""
    forwarded: list[str] = []
    tokens = list(argv)
    while tokens:
        token = tokens.pop(0)
        flag, has_value, _ = token.partition("=")
        if flag not in parser.targets:
            continue  # pd-serve's own flag (or a positional)
        takes_value = not _is_switch(parser, flag)
        value = [tokens.pop(0)] if takes_value and not has_value and tokens else []
        if target in parser.targets[flag]:
            forwarded += [token, *value]
    return forwarded


def _is_switch(parser: ArgumentParser, flag: str) -> bool:
    for action in parser._actions:  # noqa: SLF001  (argparse exposes no public lookup)
        if flag in action.option_strings:
            return action.nargs == 0
    return False


def setup_logging(args: argparse.Namespace, role: str) -> None:
    """The launcher's logging from --log-level and --log-format (`pdserve.logs`)."""
    configure_logging(args.log_level, role, args.log_format)
