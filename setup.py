"""Package discovery (everything else is in pyproject.toml).

``commsched`` and its sub-packages are found under ``commsched/``; the Triton and CPU
kernels under ``kernels/`` install as ``commsched.kernels`` (``package-dir`` in
pyproject.toml), never as a top-level ``kernels`` package.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["commsched", "commsched.*"])
packages += ["commsched.kernels"] + [f"commsched.kernels.{p}" for p in find_packages("kernels")]

setup(packages=packages)
