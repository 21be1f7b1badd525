#!/usr/bin/env bash
# the recorded REFRAG run, part 3 (docs/refrag.md): 220 more rag-stage steps from the shipped weights
# (--init: part 2's ship), with a fresh question stream (--seed 1); on a fresh machine, without part 1's checkpoint
cd /work/main
export OMP_WAIT_POLICY=passive
exec .venv/bin/python -m ragattn refrag-train --k 16 --stages rag --init ragattn/weights/refrag-k16 --seed 1 --batch 2 \
  --eval-examples 8 --encoder-layers 1 --rag-steps 220 --rag-lr 3e-4 --rag-top-k 4,17 --rag-expand 0,0.25 \
  --decoder-lora-rank 8 --checkpoint /work/runs/refrag/smollm2-minilm-k16.pt --out /work/runs/refrag/out-rag2 \
  --ship /work/runs/refrag/ship2
