import pytest
import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


@pytest.fixture(autouse=True)
def _no_kill_switch(monkeypatch):
    monkeypatch.delenv("GRAPHGUARD_DISABLE", raising=False)


@pytest.fixture
def device():
    return torch.device("cuda", torch.cuda.current_device())
