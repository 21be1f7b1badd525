"""Block-Attention fine-tuning on the shipped QA corpus (same as ``python -m ragattn finetune``).

    python scripts/finetune_block.py                     # CPU, SmolLM2-135M-Instruct, a few minutes
    python scripts/finetune_block.py --device cuda --steps 200 --batch 16 --train all
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ragattn.apps.finetune import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
