#!/usr/bin/env bash
# On a machine with one CUDA GPU and no internet: the GPU tables (bench/cuda.py: every method's layer in bf16 against
# causal SDPA, cached decoding against transformers' Llama), then the CUDA tests (tests/test_cuda.py), each step under
# its own time limit, everything written into OUT_DIR as it finishes:
#   bash tools/cuda_check.sh OUT_DIR
#   PARTS=train,decode,infer (bench.cuda's tables, in order)  BENCH_SECONDS=300  TEST_SECONDS=200  TESTS=tests/test_cuda.py
# Needs python3 with torch, pytest (pytest-xdist) and transformers; relpos is imported from this checkout; packages the
# machine lacks (fastcore) are installed from wheels in .whl/ if that folder is there. Compiled kernels are cached in
# .cuda_cache/ and packed into OUT_DIR/compile_cache.tgz, so that a later run that brings the folder back skips compiling.
# The sweep behind relpos.mha.block_rows's GPU budget is separate: python3 -m bench._gpu_block_rows OUT.txt
set -u
out=${1:-_cuda}; mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/relpos-site .whl/*.whl \
        && export PYTHONPATH=/tmp/relpos-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=$PWD/.cuda_cache/inductor TRITON_CACHE_DIR=$PWD/.cuda_cache/triton
python3 -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__)" | tee "$out/versions.txt"
start=$(date +%s)
RELPOS_BENCH_DEVICE=cuda RELPOS_CUDA_PARTS=${PARTS:-train,decode,infer} timeout "${BENCH_SECONDS:-300}" python3 -m bench cuda > "$out/bench_cuda.md" 2>&1
echo "bench cuda: exit $?, $(( $(date +%s) - start )) s"
cp nbs/data/*_cuda.json "$out/" 2>/dev/null
start=$(date +%s)
timeout "${TEST_SECONDS:-200}" python3 -m pytest -q -p no:cacheprovider -n 8 -rfE ${TESTS:-tests/test_cuda.py} > "$out/test_cuda.log" 2>&1
echo "tests: exit $?, $(( $(date +%s) - start )) s"; tail -15 "$out/test_cuda.log"
tar -czf "$out/compile_cache.tgz" .cuda_cache 2>/dev/null; ls -la "$out"
