"""horovod_dgc: gradient compression (DGC, Top-k, Gaussian-k, ScaleCom, 1-bit) for Horovod."""
from setuptools import Extension, find_packages, setup

setup(
    name="horovod_dgc",
    version="0.1.0",
    description="Deep Gradient Compression and friends as a drop-in compression= for Horovod",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["horovod_dgc", "horovod_dgc.*"]),
    python_requires=">=3.9",
    # Plain C against Python's headers only: built with the package, no torch at build time.
    # -ffp-contract=off: every product is rounded where the torch composition rounds it.
    ext_modules=[Extension(f"horovod_dgc.torch.kernels._{name}",
                           [f"horovod_dgc/torch/kernels/{name}.c"],
                           extra_compile_args=["-O3", "-ffp-contract=off"],
                           depends=["horovod_dgc/torch/kernels/common.h"])
                 for name in ("selection", "streaming", "bits")],
    install_requires=[],
    extras_require={
        # Horovod itself is compiled against the framework: see scripts/setup_env.sh.
        # 2.3: torch.amp.GradScaler, which the adapter checks for. Tested with 2.13 (every
        # path) and 2.11 (the core and the engine, on a GPU).
        "torch": ["torch>=2.3"],
        "tensorflow": ["tensorflow-cpu>=2.16", "tf_keras>=2.16"],
        # triton runs the GPU kernel's tests under its interpreter on a CPU; py-spy dumps the
        # stacks of a stuck job (make stress-hierarchical).
        "test": ["pytest>=8", "pytest-xdist>=3", "hypothesis>=6", "mpi4py>=4", "pyflakes>=3", "triton>=3", "py-spy>=0.3"],
        "examples": ["tqdm>=4.60", "mnist1d>=0.0.2", "matplotlib>=3.7"],
    },
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
    ],
)
