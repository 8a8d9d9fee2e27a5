"""GPU kernels: the grouped-matmul routes a GPU offers (XLA's ragged_dot, its Pallas-Triton lowering, Tokamax's Mosaic GPU and Triton kernels) and the table "auto" picks among them from."""
