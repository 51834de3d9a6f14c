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


@pytest.fixture(scope="session")
def qwen_tokenizer_dir() -> Path:
    """Qwen3-Base's tokenizer folder, built from the rank file that `make qwen-vocab` fetches (tools/qwen_vocab.py).
    Without that file the tests that need it skip, saying so; RSTAR2_REQUIRE_QWEN=1 (`make test` sets it) makes a
    missing file a failure instead."""
    import os
    from tools import qwen_vocab
    if not qwen_vocab.RANKS_FILE.is_file() and os.environ.get("RSTAR2_REQUIRE_QWEN") != "1":
        pytest.skip(f"the Qwen ranks are not fetched ({qwen_vocab.RANKS_FILE}): run `make qwen-vocab`")
    return qwen_vocab.tokenizer_dir()
