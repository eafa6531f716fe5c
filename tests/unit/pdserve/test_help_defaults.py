"""Issue 34: every launcher's --help names each option's default, sampling flags name the
model's defaults, and a switch that is on by default is named --no-... (it turns it off)."""

from __future__ import annotations

import argparse

import pytest

from engine.cli import build_parser as build_generate_parser
from pdserve.cli import build_parser
from pdserve.local_cluster import build_serve_parser
from router.client_cli import build_client_parser

PARSERS = {
    "pd-serve": build_serve_parser,
    "pd-router": lambda: build_parser("router"),
    "pd-prefill": lambda: build_parser("prefill"),
    "pd-decode": lambda: build_parser("decode"),
    "pd-client": build_client_parser,
    "pd-generate": build_generate_parser,
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_every_option_names_its_default(name: str) -> None:
    missing = []
    for action in PARSERS[name]()._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings:
            continue  # -h, and required positionals
        if isinstance(action, argparse._StoreTrueAction) and not action.default:
            continue  # a switch, off unless given
        if "default" not in (action.help or ""):
            missing.append(action.option_strings[0])
    assert not missing, f"{name} --help names no default for {missing}"


def test_switches_on_by_default_are_turned_off_with_no() -> None:
    for action in build_serve_parser()._actions:
        if isinstance(action, argparse._StoreFalseAction):
            assert action.option_strings[0].startswith("--no-"), action.option_strings
            assert "default: on" in action.help, action.help
    args = build_serve_parser().parse_args(["--no-kv-write-in-place", "--no-prefix-caching"])
    assert args.kv_write_in_place is False and args.enable_prefix_caching is False
    assert build_serve_parser().parse_args([]).kv_write_in_place is True


@pytest.mark.parametrize("name", ["pd-client", "pd-generate"])
def test_sampling_flags_name_the_default_models_values(name: str) -> None:
    helps = {a.option_strings[0]: a.help for a in PARSERS[name]()._actions if a.option_strings}
    # the default model's card: temperature 0.2, top_p 0.9 (pdserve.sampling_params)
    assert "0.2 for smollm2-135m" in helps["--temperature"] and "else 1.0" in helps["--temperature"]
    assert "0.9 for smollm2-135m" in helps["--top-p"]
    assert "else 16" in helps["--max-tokens"]
