"""What both node roles share: the node base (engine + KV transfer wiring, start/stop), the node
gRPC server and `Node` service, registration in the registry, proto <-> engine messages."""
