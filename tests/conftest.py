"""Shared test fixtures: where the benchmark data lives, the one-thread setting for torch, and the guard that keeps
the one-minute tier (`spec`, `make test-fast`) free of processes and network."""
import multiprocessing
import os
import socket
import subprocess
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


@pytest.fixture(autouse=True)
def spec_tests_start_no_process_and_no_connection(request, monkeypatch):
    """A test marked `spec` (`make test-fast`) that starts a process (subprocess, fork, multiprocessing) or opens a
    network connection fails, naming what it tried; unmarked tests are left alone."""
    if request.node.get_closest_marker("spec") is None:
        yield
        return

    def refuse(what):
        def refused(*args, **kwargs):
            raise RuntimeError(f"a `spec` test may not {what}: move it out of the tier (tests/conftest.py)")
        return refused
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse("start a subprocess"))
    monkeypatch.setattr(os, "fork", refuse("fork"))
    monkeypatch.setattr(os, "posix_spawn", refuse("spawn a process"))
    monkeypatch.setattr(multiprocessing.Process, "start", refuse("start a process"))
    monkeypatch.setattr(socket.socket, "connect", refuse("open a network connection"))
    yield
