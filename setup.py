"""fp8boost: FP8 training for PyTorch on Hopper GPUs (Booster + plugins, Triton kernels)."""
from setuptools import find_packages, setup

setup(
    name="fp8boost",
    version="0.1.0",
    description="FP8 training library for PyTorch: Booster/plugins, Triton FP8 kernels, FP8 collectives",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    packages=find_packages(include=["fp8boost", "fp8boost.*"]),
    package_data={"fp8boost": ["data/*.txt"]},
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.6",
        "triton>=3.2; platform_system == 'Linux'",
        "transformers>=4.45",
        "accelerate>=0.34",
        "safetensors>=0.4",
        "numpy",
    ],
    extras_require={
        # tensorboard: the example's --tensorboard (its test writes real event files)
        # peft: Booster.enable_lora / save_lora_as_pretrained (and their tests)
        # compressed-tensors: the FP8 export's compressed-tensors layout is checked with it
        # pytest-xdist: the README's `pytest -n 2` (CI's 2 cores)
        "dev": ["pytest>=8", "pytest-xdist>=3", "expecttest", "matplotlib", "tensorboard",
                "peft>=0.13", "compressed-tensors>=0.10"],
        "lora": ["peft>=0.13"],
    },
)
