"""An import-only stand-in for xprof, for the GPU machine (no xprof there).

tokamax 0.0.17 imports `xprof.cli.tools.get_kernel_stats_tool` when it is
imported (tokamax/_src/benchmarking.py) and calls it only to time kernels
through an xprof session (`TimingMethod` "xprof"), which this project never
asks of it; without any xprof `import tokamax` fails, and on the GPU
`grouped_matmul="auto"` would quietly fall back to "blocked". The real
xprof and its requirements are 76 MB of wheels, more than a call carries,
so benchmarks/gpu/one_gpu.sh puts this folder on PYTHONPATH where the
machine has no xprof. A call into it raises.
"""

STANDIN = True
