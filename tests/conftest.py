"""Test-wide settings: tiny CPU kernels run fastest single-threaded on the 2-core CI machines."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch.set_num_threads(1)
