#!/usr/bin/env bash
# On a machine with a GPU: the CUDA tests (tests/test_cuda.py, the bias methods' FlexAttention route included), then chapters' benchmarks with every case on the GPU,
# each table into OUT_DIR/<chapter>.md (at most 8 files: the device tool brings back no more). Needs only python3 with
# torch and pytest (no venv: relpos is imported from this checkout).
#   bash tools/cuda_check.sh OUT_DIR      chapters: $CHAPTERS (default below); seconds each: $SECONDS_PER_CHAPTER
# (fire's table: CHAPTERS="fire ...", seven chapters at most with the log)
# The sweep behind relpos.mha.block_rows's GPU budget is separate: python3 -m bench._gpu_block_rows OUT.txt
set -u
out=${1:-_cuda}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
{ python3 -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
  timeout "${TEST_SECONDS:-420}" python3 -m pytest -q -p no:cacheprovider tests/test_cuda.py 2>&1; } > "$out/test_cuda.log"
tail -5 "$out/test_cuda.log"
for chapter in ${CHAPTERS:-relative_mha models shaw fourier t5 alibi rotary}; do
    start=$(date +%s)
    RELPOS_BENCH_DEVICE=cuda timeout "${SECONDS_PER_CHAPTER:-120}" python3 -m bench "$chapter" > "$out/$chapter.md" 2>&1
    echo "$chapter: exit $?, $(( $(date +%s) - start )) s"
done
