"""Finds the packages, so that a new subpackage can never be left out of the
wheel; everything else is in pyproject.toml.

`configs/` stays at the top of the repository (tools and users read it
there) and ships as the package `linen_moe.configs`, its data directories
(`configs/hf/<model>/`, the released models' config.json) as namespace
packages of it; likewise `_src/planning/gpu_specs/` (XLA's GPU target
descriptions), a data directory inside the package.
"""

import setuptools

setuptools.setup(
    packages=[
        *setuptools.find_packages(include=["linen_moe*", "nnx_adapter*"]),
        "linen_moe._src.planning.gpu_specs",
        "linen_moe.configs",
        *(
            f"linen_moe.configs.{p}"
            for p in setuptools.find_namespace_packages(
                where="configs", exclude=["*__pycache__*"]
            )
        ),
    ],
    package_dir={"linen_moe.configs": "configs"},
)
