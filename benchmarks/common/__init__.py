"""What the benchmark scripts share: timing, the layer case, the whole model.

Benchmarks run from a checkout against the installed package; each script
puts `benchmarks/` first on `sys.path` to import this package, and imports
only public names of `linen_moe` and `nnx_adapter`.
"""
