"""Draft heads shipped with specd, one directory each (`models.eagle_head` reads them).

No torch here: the CLI's settings name the default head before any model code loads.
"""

from pathlib import Path

# Made by `specd train-draft` for the bundled SmolLM2-135M-Instruct (its training record is in eagle_head.json).
BUNDLED_HEAD_DIR = Path(__file__).resolve().parent / "smollm2-135m-instruct"
