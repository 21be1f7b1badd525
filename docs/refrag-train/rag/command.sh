#!/usr/bin/env bash
# the recorded REFRAG run, part 2 (docs/refrag.md): the rag stage from part 1's checkpoint (recon + cpt);
# OMP_WAIT_POLICY=passive keeps OpenMP's idle threads from spinning on a shared machine
cd /work/main
export OMP_WAIT_POLICY=passive
exec .venv/bin/python -m ragattn refrag-train --k 16 --stages rag --resume --batch 2 --eval-examples 8 \
  --encoder-layers 1 --rag-steps 220 --rag-lr 3e-4 --rag-top-k 4,17 --rag-expand 0,0.25 --decoder-lora-rank 8 \
  --checkpoint /work/runs/refrag/smollm2-minilm-k16.pt --out /work/runs/refrag/out-rag --ship /work/runs/refrag/ship
