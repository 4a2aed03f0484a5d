OVERLAP_SETTINGS=pdl OVERLAP_ROUNDS=2 OVERLAP_SHAPES=8x1024,4x1024 OVERLAP_TUNES='{"": {}, "s16": {"swiglu_warps": 16}, "s24": {"swiglu_warps": 24}}' timeout 100 python3 bench/overlap.py mxfp4 2>&1 | tail -9
timeout 100 python3 -m pytest -q -m gpu tests/gpu/test_fused_swiglu.py -k own_width -n 16 -p no:cacheprovider -W ignore 2>&1 | tail -3
