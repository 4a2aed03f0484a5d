"""What an installed decapybara puts into site-packages: its own import names only, and the kernel sources.

The CUDA sources live in `decapybara/kernels/`, imported as `decapybara.kernels`. A top-level `kernels` package
would shadow Hugging Face's `kernels` distribution (transformers requires and imports it from 5.25), and a
wheel holding one would overwrite its files.
"""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    """A wheel built from a copy of this checkout without its build outputs (a stale build/lib would be packed
    too), no dependencies, the installed setuptools."""
    src, out = tmp_path_factory.mktemp("src") / "decapybara", tmp_path_factory.mktemp("wheel")
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".git", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".venv", ".device_out", ".whl",
        ".data"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    (whl,) = out.glob("decapybara-*.whl")
    return zipfile.ZipFile(whl)


def test_the_wheel_installs_no_top_level_name_but_its_own(wheel):
    tops = {name.split("/")[0] for name in wheel.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert tops == {"decapybara", "actors"}, tops


def test_the_wheel_carries_every_kernel_source(wheel):
    sources = {p.name for p in (ROOT / "decapybara" / "kernels").iterdir() if p.suffix in (".cu", ".cuh")}
    assert {"mx_gemv.cu", "common.cuh", "probe.cu"} <= sources
    shipped = {name.rsplit("/", 1)[1] for name in wheel.namelist() if name.startswith("decapybara/kernels/")}
    assert sources <= shipped, sources - shipped


def test_kernels_is_not_an_import_name_of_this_checkout():
    """From the repository root (the first entry of sys.path under pytest and `serve run`), `import kernels`
    must not find anything of this project: it is Hugging Face's, where installed."""
    code = "import importlib.util; s = importlib.util.find_spec('kernels'); print(s.origin if s else '')"
    origin = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout.strip()
    assert not origin or not Path(origin).resolve().is_relative_to(ROOT), origin


def test_the_loader_reads_its_sources_from_the_package():
    from decapybara import kernels

    assert kernels.KERNEL_DIR == ROOT / "decapybara" / "kernels"
    assert importlib.util.find_spec("decapybara.kernels").origin == str(kernels.KERNEL_DIR / "__init__.py")
    assert (kernels.KERNEL_DIR / "mx_gemv.cu").is_file()
