"""The one module tokamax imports of xprof; a call raises (import only)."""


def compute_kernel_stats(*args, **kwargs):
  """Raises: xprof is not installed, only this stand-in (for the import)."""
  del args, kwargs
  raise RuntimeError(
      "xprof is not installed here, only benchmarks/gpu/standin's import-only"
      " stand-in: time tokamax's kernels with timing_method='wallclock' or"
      " 'cupti'"
  )
