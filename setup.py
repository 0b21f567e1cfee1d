"""Packaging for horovod-ray: Horovod training jobs on a Ray cluster."""

import os

from setuptools import find_packages, setup

_HERE = os.path.dirname(os.path.abspath(__file__))


def _read(*parts: str) -> str:
    with open(os.path.join(_HERE, *parts), encoding="utf-8") as handle:
        return handle.read()


def _version() -> str:
    scope: dict = {}
    exec(_read("horovod_ray", "__version__.py"), scope)
    return scope["__version__"]


setup(
    name="horovod-ray",
    version=_version(),
    description="Run Horovod (Gloo) training jobs on a Ray cluster",
    long_description=_read("README.rst"),
    long_description_content_type="text/x-rst",
    packages=find_packages(include=["horovod_ray", "horovod_ray.*"]),
    python_requires=">=3.11,<3.12",
    # horovod must be built with Gloo (HOROVOD_WITH_GLOO=1); see docs/install.rst. Ray is
    # capped below its next major: the local Ray of run() and horovod_ray.tune use a few of
    # Ray 2's internals (horovod_ray.tune checks for its two at import).
    install_requires=["ray[default]>=2.60,<3", "horovod>=0.28.1", "cloudpickle"],
    entry_points={"console_scripts": ["horovod-ray=horovod_ray.cli.main:main"]},
    extras_require={
        # Two TensorFlow lines are built and tested (docs/install.rst): today's, with
        # Keras 3, and the 2023 line, whose tf.keras is Keras 2.
        "tensorflow": ["tensorflow-cpu>=2.21,<2.22", "keras>=3.15,<4"],
        "tensorflow-2023": ["tensorflow-cpu>=2.15,<2.16"],
        # The TensorFlow GPU line (make install GPU=tf): the GPU build and its CUDA 12 libraries.
        "tensorflow-gpu": ["tensorflow[and-cuda]>=2.21,<2.22", "keras>=3.15,<4"],
        # horovod.torch: horovod must be built against this PyTorch (make install does);
        # 2.13 on the default line, 2.14 (CUDA 13) on the GPU line.
        "torch": ["torch>=2.13,<2.15"],
        "tune": ["ray[tune]>=2.60,<3"],
        # moto: a local S3-compatible server for the storage tests (its server needs flask).
        "test": [
            "pytest>=7",
            "pytest-timeout",
            "ruff",
            "scikit-learn",
            "docutils",
            "psutil>=6",
            "moto[s3,server]>=5.2,<6",
            # The Kubernetes models that deploy/kuberay's pod templates are checked against.
            "kubernetes>=31",
        ],
        "examples": ["scikit-learn"],
        "bench": ["matplotlib"],
        # make docs: the Sphinx site, its API reference and the CLI's generated flag list.
        "docs": ["sphinx>=8.2,<9", "sphinx-argparse>=0.5,<0.6"],
    },
    classifiers=[
        "Programming Language :: Python :: 3.11",
        "Programming Language :: Python :: 3 :: Only",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
