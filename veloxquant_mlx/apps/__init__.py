"""Applications on top of the adapter: saved caches, the server, distributed runs, the demo, the CPU BLAS preload."""
