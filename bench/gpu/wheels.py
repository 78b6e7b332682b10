"""Download the wheels that bench/gpu.sh needs on a GPU node whose Python lacks them (`make gpu-wheels`).

A GPU node's Python, a PyTorch container say, often has torch, pandas, sacrebleu, sentencepiece,
matplotlib and the rest of IMAGE, but no snakemake, MLflow or sacremoses, and the node no network. This takes ROOTS, walks their requirements in this
virtual environment (installed from requirements.lock, so every version is the lock's), keeps those the
image lacks, and downloads each at the lock's version for the GPU's Python into a git-ignored folder
(`.whl`) that bench/gpu.sh installs from on the node. Pure-Python packages published only as a source archive
are built into a wheel here. PuLP is left out: it serves only Snakemake's ILP scheduler (a 16 MB
solver binary), and bench/gpu.sh runs `--scheduler greedy`.

    .venv/bin/python -m bench.gpu.wheels --python-version 3.12 --dest .whl
    .venv/bin/python -m bench.gpu.wheels --image    # what we use of the image: to mimic it in a fresh venv
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

REPO = Path(__file__).resolve().parents[2]

# What the pipeline imports beyond the image: the workflow engine, MLflow's sqlite store, Moses tokenisation.
ROOTS = ["snakemake", "mlflow-skinny", "mlflow-tracing", "sqlalchemy", "alembic", "sacremoses"]
LEFT_OUT = {"pulp"}
# What the pipeline imports that the image has (not `datasets`: the demo corpus is generated; not the
# slurm plugin; not full `mlflow`, whose server the sqlite store does not need).
USED_FROM_IMAGE = ["torch", "sentencepiece", "sacrebleu", "pandas", "pyarrow", "matplotlib", "tqdm", "pyyaml",
                   "psutil"]

# The Python packages of a PyTorch GPU container image (the one bench/gpu.sh was first run in, read 2026-11-17).
IMAGE = set("""
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core cuda-pathfinder
cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools
formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize hypothesis idna
imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver
lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe
matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals
networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime
nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13
nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy
peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments
pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp
""".split())

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64"]


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: list[str]) -> dict[str, set[str]]:
    """Every distribution the roots need (markers evaluated here, extras off), each with what needs it."""
    needed_by: dict[str, set[str]] = {}
    pending = [(root, "") for root in roots]
    while pending:
        name, parent = pending.pop()
        key = normalise(name)
        first = key not in needed_by
        needed_by.setdefault(key, set()).update({parent} - {""})
        if not first:
            continue
        for line in importlib.metadata.distribution(name).requires or []:
            requirement = Requirement(line)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                pending.append((requirement.name, key))
    return needed_by


def carried(roots: list[str] = ROOTS) -> dict[str, str]:
    """name -> the lock's version, for each needed distribution that the image lacks."""
    image = {normalise(name) for name in IMAGE}
    return {name: importlib.metadata.version(name) for name in sorted(closure(roots))
            if name not in image and name not in LEFT_OUT}


def from_image() -> dict[str, str]:
    """name -> the lock's version, for each package the pipeline needs that the image already has."""
    image = {normalise(name) for name in IMAGE}
    needed = closure(ROOTS + USED_FROM_IMAGE)
    return {name: importlib.metadata.version(name) for name in sorted(needed) if name in image}


def download(pins: dict[str, str], python_version: str, dest: Path) -> None:
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    platforms = [option for platform in PLATFORMS for option in ("--platform", platform)]
    for name, version in pins.items():
        fetched = subprocess.run(
            [*pip, "download", "--quiet", "--no-deps", "--only-binary=:all:", "--python-version", python_version,
             "--implementation", "cp", *platforms, "--dest", str(dest), f"{name}=={version}"],
            capture_output=True, text=True)
        if fetched.returncode == 0:
            continue
        # published as a source archive only: build it, and keep it only if it is pure Python
        before = set(dest.iterdir())
        subprocess.run([*pip, "wheel", "--quiet", "--no-deps", "--wheel-dir", str(dest), f"{name}=={version}"],
                       check=True)
        for built in set(dest.iterdir()) - before:
            if not built.name.endswith("-py3-none-any.whl"):
                raise SystemExit(f"error: {name}=={version} has no wheel for Python {python_version} on x86-64 "
                                 f"and builds to a platform wheel here ({built.name})")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python-version", default="3.12", help="the GPU image's Python (3.12)")
    parser.add_argument("--dest", type=Path, default=REPO / ".whl")
    parser.add_argument("--list", action="store_true", help="print name==version a line and download nothing")
    parser.add_argument("--image", action="store_true",
                        help="print name==version of what the pipeline uses that the image has, and download nothing")
    args = parser.parse_args(argv)
    pins = carried()
    if args.list or args.image:
        listed = from_image() if args.image else pins
        print("\n".join(f"{name}=={version}" for name, version in listed.items()))
        return 0
    shutil.rmtree(args.dest, ignore_errors=True)
    args.dest.mkdir(parents=True)
    download(pins, args.python_version, args.dest)
    wheels = sorted(args.dest.glob("*.whl"))
    if len(wheels) != len(pins):
        raise SystemExit(f"error: {len(pins)} packages but {len(wheels)} wheels in {args.dest}")
    size = sum(wheel.stat().st_size for wheel in wheels)
    print(f"{len(wheels)} wheels for Python {args.python_version} in {args.dest}: {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
