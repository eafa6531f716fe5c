"""How one layer of one request's KV travels: packed into one buffer, or copied block to block.

block_ids.py       CheckedIds, check_block_ids: block ids checked once, on the cache's device
packed_layer.py    pack_layer / unpack_layer: the packed-layer format (K then V, whole blocks)
block_copy.py      LayerBlocks, copy_layer(s): blocks into another pool's, nothing packed
rows.py            how the copies see blocks: rows of int64 words; whether Triton runs
staging_pool.py    StagingPool: the buffers packed layers travel in, reused
checked_caches.py  derived(): checks and views of a set of caches, made once
"""
