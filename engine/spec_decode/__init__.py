"""Speculative decoding: proposers (n-gram prompt lookup, a draft model), the verify step's
sampling rows and acceptance rule, the landing of a verify step (stop checks, KV rollback).
See "Speculative decoding" in engine/README.md."""

from engine.spec_decode.parts import SpecDecodeParts
from engine.spec_decode.proposer import Proposer
from engine.spec_decode.spec_decoder import SpecDecoder
from engine.spec_decode.stats import SpecDecodeStats

__all__ = ["Proposer", "SpecDecodeParts", "SpecDecodeStats", "SpecDecoder"]
