"""Only the C helper lives here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstored.shm._safecopy", ["kvstored/shm/_safecopy.c"], optional=True)])
