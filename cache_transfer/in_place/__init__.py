"""Writes in place: a prefill node on the decode node's own GPU copies each layer straight into
the receiver's blocks (cache_transfer/README.md, "Writes in place").

    pool_sharing.py      PoolSharing: the receiver's caches exported, mapped by the sender
    writer.py            InPlaceWriter: the copies into a mapped pool (only the ticket's blocks)
    sender_writes.py     InPlaceWrites: the part of a KVSender that asks, writes and drains
    receiver_grant.py    InPlaceGrant: the part of a KVReceiver that grants, and quarantines
                         its blocks until the sender's writes settled
"""
