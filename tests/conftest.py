"""Shared test fixtures: where the benchmark data lives, and the one-thread setting for torch."""
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """The benchmark files shipped in data/ (AIME 2024/2025, HMMT Feb 2025, MATH-500; see data/SOURCES.md)."""
    return ROOT / "data"


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two OpenMP threads on a 2-core machine crawl when anything else runs (tool workers, other tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
