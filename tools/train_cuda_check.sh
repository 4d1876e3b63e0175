#!/usr/bin/env bash
# On a machine with one CUDA GPU (no internet needed): `python -m relpos.train` under torchrun with NCCL on that GPU, bf16,
# a few dozen steps per run, and each run's progress lines (loss, tokens/s). Runs: rotary under DDP; Transformer-XL
# with memory under FSDP2 with activation checkpointing, stopped and resumed from its checkpoint; rotary under FSDP2
# with --compile; FIRE under FSDP2. Needs python3 with torch and fastcore (and numpy, which relpos imports); relpos is
# imported from this checkout, the training text is made from its own files.
#   bash tools/train_cuda_check.sh [OUT_DIR]      seconds per run: $SECONDS_PER_RUN (default 240)
set -u
out=${1:-_train_cuda}; mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
python3 -c "import torch, fastcore; assert torch.cuda.is_available(), 'no CUDA device'; print('torch', torch.__version__, torch.cuda.get_device_name(), 'nccl', torch.cuda.nccl.version())" || exit 1
data=$out/data.txt
cat nbs/*.ipynb relpos/*.py LICENSE > "$data"              # about 5 MB of text
model=(--d-model 512 --heads 8 --n-layers 8 --seq-len 1024 --batch-size 16 --steps 40 --warmup 10 --lr 1e-3 --log-every 10 --dtype bf16)

run() {   # name, then options for relpos.train
    local name=$1; shift
    local start=$(date +%s)
    timeout "${SECONDS_PER_RUN:-240}" python3 -m torch.distributed.run --standalone --nproc_per_node 1 -m relpos.train \
        --data "$data" "${model[@]}" "$@" > "$out/$name.log" 2>&1
    local status=$?
    echo "== $name: exit $status, $(( $(date +%s) - start )) s"
    grep -E '^(step|resumed)' "$out/$name.log"
    [ $status = 0 ] || tail -20 "$out/$name.log"
}

run rotary_ddp --position rotary --strategy ddp
run xl_fsdp_ckpt_part1 --position xl --mem-len 512 --strategy fsdp --checkpoint-activations --ckpt-dir "$out/ckpt_xl" --stop-at 20
run xl_fsdp_ckpt_part2 --position xl --mem-len 512 --strategy fsdp --checkpoint-activations --ckpt-dir "$out/ckpt_xl" --resume
run rotary_fsdp_compile --position rotary --strategy fsdp --compile
run fire_fsdp --position fire --strategy fsdp
rm -rf "$out/ckpt_xl" "$data"
