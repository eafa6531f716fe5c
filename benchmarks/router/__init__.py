"""pd-bench router: the router against instant nodes (torch-free)."""
