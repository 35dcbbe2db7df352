import os

# Keep each test process to one thread: the suite runs several ranks on two cores.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` need a CUDA device; without one they are skipped, saying so."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (none here)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def no_network(monkeypatch):
    """Every connection attempt and name lookup in this process fails at once (a machine
    without network): code that would download must say so instead."""
    import socket

    def refuse(*_a, **_k):
        raise OSError("network access is disabled in this test")

    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
