"""Device scripts (shell) for the lent GPU machines, and the GPU time-slicing probe."""
