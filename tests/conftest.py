"""Shared pytest set-up: the repository root on sys.path and one torch thread per process
(the CI machines are shared; two-thread runs slow down 10-30x when a neighbour is busy)."""
import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

torch.set_num_threads(1)
