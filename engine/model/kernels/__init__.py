"""Native CPU kernels, built on first use; every one has a torch fallback."""
