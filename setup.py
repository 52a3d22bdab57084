"""Install the service folders under one import namespace, ``headrace.*``.

The folders stay at the repository root (DESIGN.md "Layout"); this maps each to
``headrace.<folder>`` with setuptools' package-dir, and finds their sub-packages, so a new
sub-package needs no edit here. Everything else about the distribution is in pyproject.toml.
"""

from setuptools import find_namespace_packages, setup

SERVICES = ("shared", "buffer", "rollout", "trainer", "deploy")

packages = ["headrace"]
package_dir = {"headrace": "headrace"}
for folder in SERVICES:
    package_dir[f"headrace.{folder}"] = folder
    packages += [f"headrace.{folder}"] + [f"headrace.{folder}.{sub}" for sub in find_namespace_packages(folder, exclude=["*__pycache__*"])]

setup(packages=packages, package_dir=package_dir)
