"""Only the optional C helper lives here; everything else is in pyproject.toml.

kvtier.pagetable._native (hashing and probing of the page table's index) is built when a C
compiler and the Python headers are present; where it fails to build, the package installs
anyway and the page table uses its numpy implementation (the same results, slower).
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvtier.pagetable._native", ["kvtier/pagetable/_native.c"],
                             extra_compile_args=["-O3", "-std=c11"], optional=True)])
