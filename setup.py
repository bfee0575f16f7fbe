"""Packaging beyond what pyproject.toml can say: ship the checkout's ``benchmarks/`` scripts inside
the wheel as ``kvcodec/_bench/benchmarks/`` so that ``kvcodec bench`` runs from a pip install
(``kvcodec.benchrunner`` looks there first). Everything else is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=find_packages(include=["kvcodec", "kvcodec.*"]) + ["kvcodec._bench.benchmarks"],
    package_dir={"kvcodec._bench.benchmarks": "benchmarks"},
    exclude_package_data={"kvcodec._bench.benchmarks": ["results/*", "results/*/*", "*.md"]},  # scripts only
)
