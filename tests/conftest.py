"""Test-wide settings: tiny CPU kernels run fastest single-threaded on the 2-core CI machines.

Worker processes (process mode) inherit ``OMP_NUM_THREADS=1``: the same single intra-op thread as this process, so
their CPU reductions add in the same order as the single-device reference (bit-identical results), and two test
processes with their workers do not oversubscribe the two cores."""

from __future__ import annotations

import os

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(1)
