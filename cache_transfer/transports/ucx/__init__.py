"""The ucx KV transport on UCXX (see cache_transfer/README.md): `transport` (UcxTransport),
`runtime` (imports ucxx once, with pdserve's UCX defaults), `inbound` / `outbound` (the two
directions of one endpoint), `wire` (the framing). Importing this package does not load ucxx;
`cache_transfer.transports.make_transport("ucx")` does."""
