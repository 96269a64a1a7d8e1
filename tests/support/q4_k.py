"""Q4_K blocks as a GGUF file holds them, for tests of the formats that read them."""

from __future__ import annotations

import numpy as np


def q4_k_blocks(rows: int, cols: int, seed: int = 6) -> np.ndarray:
    """Random Q4_K blocks, as a GGUF holds them: [rows, cols / 256 * 144] bytes."""
    rng = np.random.default_rng(seed)
    supers = rows * cols // 256
    halves = (rng.random((supers, 2)) * 0.01 + 0.001).astype(np.float16)  # d, dmin
    sc, m = rng.integers(0, 64, (supers, 8)), rng.integers(0, 64, (supers, 8))
    scales = np.zeros((supers, 12), dtype=np.uint8)
    scales[:, 0:4] = (sc[:, :4] & 63) | (sc[:, 4:] >> 4) << 6  # 6 bits each, the top two of sc[4:] above
    scales[:, 4:8] = (m[:, :4] & 63) | (m[:, 4:] >> 4) << 6
    scales[:, 8:12] = (sc[:, 4:] & 15) | (m[:, 4:] & 15) << 4
    codes = rng.integers(0, 256, (supers, 128), dtype=np.uint8)  # two 4-bit codes a byte
    blocks = np.concatenate([halves.view(np.uint8), scales, codes], axis=1)
    return blocks.reshape(rows, -1)
