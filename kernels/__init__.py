"""pdserve kernels: attention backends and GPU kernels, each beside its torch reference."""
