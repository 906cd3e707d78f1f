# SPDX-License-Identifier: Apache-2.0
# SPDX-FileCopyrightText: Copyright contributors to the kvstored project
"""Only the C helper lives here; everything else is in pyproject.toml."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kvstored.shm._safecopy", ["kvstored/shm/_safecopy.c"], optional=True)])
