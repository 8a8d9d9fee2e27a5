"""TPU kernels: this project's Pallas grouped matmuls and row gathers, jax's megablox, Tokamax's Mosaic TPU kernel, and the tile table measured on TPU chips."""
