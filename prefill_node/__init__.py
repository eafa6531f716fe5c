"""The prefill role: gRPC servicer and lifecycle around a prefill-only engine (README.md)."""
