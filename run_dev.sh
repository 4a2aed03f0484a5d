set -x
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
python3 -c "import transformers, cupy, importlib.util as u; print(transformers.__version__, cupy.__version__, u.find_spec('kernels'))"
date -u
timeout 540 python3 -m pytest -q -m gpu tests/gpu -n 16 --dist load -p no:cacheprovider 2>&1 | tail -25
date -u
