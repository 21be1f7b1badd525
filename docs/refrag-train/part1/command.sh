#!/usr/bin/env bash
# the recorded REFRAG run (docs/refrag.md): OMP_WAIT_POLICY=passive keeps OpenMP's idle threads from spinning
cd /work/main
export OMP_WAIT_POLICY=passive
exec .venv/bin/python -m ragattn refrag-train --k 16 --stages recon,cpt,rag --batch 4 --max-chunks 8 \
  --curriculum-stages 4 --target-tokens 32 --eval-examples 8 --encoder-layers 1 \
  --recon-steps 150 --recon-lr 1e-3 --cpt-steps 100 --cpt-lr 3e-4 --expand-p 0.25 \
  --rag-steps 360 --rag-lr 3e-4 --rag-top-k 4,17 --rag-expand 0,0.25 --decoder-lora-rank 8 \
  --checkpoint /work/runs/refrag/smollm2-minilm-k16.pt --out /work/runs/refrag/out --ship /work/runs/refrag/ship
