"""Package discovery (metadata lives in pyproject.toml).

Every package under ``fsdp_plugin/`` is found, none listed by hand; the top-level ``integrations/`` folder
installs as ``fsdp_plugin.integrations`` (the layout of the product's design card)."""
from setuptools import find_packages, setup

ENGINE = find_packages(include=["fsdp_plugin", "fsdp_plugin.*"])
INTEGRATIONS = ["fsdp_plugin." + p for p in find_packages(include=["integrations", "integrations.*"])]

setup(packages=ENGINE + INTEGRATIONS, package_dir={"fsdp_plugin.integrations": "integrations"})
