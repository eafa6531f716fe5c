"""pd-bench serve, compare, dataset and ttft: torch-free clients of a router (a `pd-serve` they
start, or one at `--addr`)."""
