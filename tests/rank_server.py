"""Imported by the fork server of tests/rank_processes.py before it forks any rank: what
every rank would otherwise import and make itself. No thread is left running: torch on
one thread (a rank's own setting; OpenMP's team would not survive the fork) and the
warm-up's trainer, with its ONNX Runtime session, freed before the first fork."""

from __future__ import annotations

import gc
import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch

torch.set_num_threads(1)

import torch.distributed  # noqa: E402
from transformers import GPT2LMHeadModel  # noqa: E402, F401

import ortrain  # noqa: E402, F401
from ortrain.build_warmup import warm_builds  # noqa: E402
from tests import conftest, dist_worker  # noqa: E402, F401

conftest._quiet_transformers()
warm_builds()
gc.collect()
