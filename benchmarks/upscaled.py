"""Digits drawn larger, for benchmarks whose steps must be long against a CPU quota's period.

`--dataset upscaled:digits --dataset-args '{"scale": 2}'` (with benchmarks/ on PYTHONPATH):
scikit-learn's 8x8 digits, each image resized to (8 scale)^2 by bilinear interpolation. A
cnn's compute per sample grows scale^2 times, its parameters do not (the cnn pools to 2x2
before its last layer), and an epoch keeps its 1,437 training samples: longer steps
without more traffic or more evaluations (benchmarks/cgroup.py).
"""

import os
from pathlib import Path

import torch.nn.functional as F
from torch.utils.data import TensorDataset

from omnips.data import FactoryError
from omnips.data import digits as small_digits


def importable() -> dict[str, str]:
    """The environment a process needs to import this data set: benchmarks/ on its PYTHONPATH."""
    here = str(Path(__file__).resolve().parent)
    return {"PYTHONPATH": os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))}


def digits(scale: int = 2, test_fraction: float = 0.2, split_seed: int = 0):
    if not isinstance(scale, int) or scale < 1:
        raise FactoryError(f"scale must be a whole number >= 1, not {scale!r}")
    return tuple(TensorDataset(F.interpolate(x, scale_factor=scale, mode="bilinear", align_corners=False), y)
                 for x, y in (part.tensors for part in small_digits(test_fraction, split_seed)))
