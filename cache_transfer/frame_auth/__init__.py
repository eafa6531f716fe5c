"""With a cluster secret, a hand-off's messages are authenticated end to end
(cache_transfer/README.md, "Authentication"):

    challenges.py        Challenges: the nonces a receiver issued, one per connection, each
                         accepted in one handshake only; signed challenges and refusals
    frame_key.py         FrameKey: a transfer's MAC key (secret, transfer id, nonce,
                         connection); the tag of one message, its place in the header
    payload_digests.py   what a tag covers of a payload: its bytes (host memory), or its keyed
                         digest computed on the GPU (kernels/kv_digest), awaited off the loop
    frame_sealer.py      FrameSealer: the part a session owns (seal outgoing headers, open
                         incoming ones; None of it without a secret)
"""
