"""Shared test fixtures: makes tests/ importable for helpers such as dist_utils."""

import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
os.environ.setdefault("OMP_NUM_THREADS", "1")
