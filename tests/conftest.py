"""Shared test fixtures: where the benchmark data lives, and a tiny model built once per session."""
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def shared_data_dir() -> Path | None:
    """../shared/data beside the checkout (or $RSTAR2_DATA_DIR); None where a user's clone lacks it."""
    path = Path(os.environ.get("RSTAR2_DATA_DIR", ROOT.parent / "shared" / "data"))
    return path if (path / "aime24.jsonl").is_file() else None


@pytest.fixture(scope="session")
def data_dir() -> Path:
    """Benchmark files. Skips with the reason in a user's clone; CI always has them, so there it fails instead."""
    path = shared_data_dir()
    if path is None:
        if os.environ.get("CI"):
            pytest.fail("CI must have ../shared/data (AIME/HMMT/MATH-500 JSONL) beside the checkout")
        pytest.skip("benchmark data not found: put the JSONL files in ../shared/data or set RSTAR2_DATA_DIR")
    return path


@pytest.fixture(scope="module")
def one_torch_thread():
    """Two OpenMP threads on a 2-core machine crawl when anything else runs (tool workers, other tests)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
