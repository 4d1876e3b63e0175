#!/usr/bin/env bash
# On a machine with one CUDA GPU and no internet: the GPU tables of bench/cuda.py (every method's layer in bf16 against
# causal SDPA; cached decoding against transformers' Llama; a profile of where a step's time goes) and the CUDA tests
# (tests/test_cuda.py), each step under its own time limit in seconds, in the order given, everything written into
# OUT_DIR as it finishes:
#   STEPS=train:190,tests:110,flex:50,infer:60,decode:60 bash tools/cuda_check.sh OUT_DIR
# OUT_DIR gets versions.txt, bench.log (every step's output), test_cuda.log and the nbs/data/*_cuda.json it stored.
# Needs python3 with torch, pytest (pytest-xdist) and transformers; relpos is imported from this checkout; packages the
# machine lacks (fastcore) are installed from wheels in .whl/ if that folder is there, made beforehand on a machine with
# an index: python3 -m pip download --no-deps --only-binary=:all: -d .whl fastcore
# The sweep behind relpos.mha.block_rows's GPU budget is separate: python3 -m bench._gpu_block_rows OUT.txt
set -u
out=${1:-_cuda}; mkdir -p "$out"
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/relpos-site .whl/*.whl \
        && export PYTHONPATH=/tmp/relpos-site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 -c "import torch, transformers; print('torch', torch.__version__, torch.cuda.get_device_name(), 'transformers', transformers.__version__)" | tee "$out/versions.txt"
for step in $(echo "${STEPS:-train:300,decode:120,infer:200,tests:300}" | tr ',' ' '); do
    name=${step%%:*}; seconds=${step##*:}; start=$(date +%s)
    if [ "$name" = tests ]; then
        # -v: each result as it comes; SIGINT at the limit: pytest still prints the failures it has seen
        timeout -s INT -k 15 "$seconds" python3 -m pytest -v -p no:cacheprovider -n 8 -rfE ${TESTS:-tests/test_cuda.py} > "$out/test_cuda.log" 2>&1
        echo "tests: exit $?, $(( $(date +%s) - start )) s"; grep -E "^(FAILED|ERROR)|passed|failed|FAILED tests" "$out/test_cuda.log" | tail -40
    else
        echo "## $name" >> "$out/bench.log"   # one log for every step: what comes back from a lent GPU is a few files
        RELPOS_BENCH_DEVICE=cuda RELPOS_CUDA_PARTS=$name timeout "$seconds" python3 -m bench cuda >> "$out/bench.log" 2>&1
        echo "$name: exit $?, $(( $(date +%s) - start )) s"
        cp nbs/data/*_cuda.json "$out/" 2>/dev/null
    fi
done
