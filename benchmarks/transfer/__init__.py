"""pd-bench transfer: one request's KV between two processes through cache_transfer, against
the ceilings measured in the same run."""
