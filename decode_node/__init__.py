"""The decode role: reserve blocks, receive KV, decode, stream; also prefills locally (README.md)."""
