"""EngineConfig.cpu_threads: torch's intra-op threads set at start-up, for every thread that runs
the engine afterwards (the server's worker thread is not the one that built it)."""

from __future__ import annotations

import threading

import pytest
import torch

from engine import EngineConfig

from .helpers import make_engine


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_cpu_threads_apply_to_later_threads(build_model, restore_threads):
    engine = make_engine(build_model("tiny-llama"), cpu_threads=1)
    seen = {}

    def step_elsewhere():
        engine.generate([[11, 12, 13]], None)
        seen["threads"] = torch.get_num_threads()

    t = threading.Thread(target=step_elsewhere)
    t.start()
    t.join()
    assert torch.get_num_threads() == 1 and seen["threads"] == 1


def test_none_leaves_torch_alone_and_bad_values_are_refused(build_model, restore_threads):
    torch.set_num_threads(2)
    make_engine(build_model("tiny-llama"))
    assert torch.get_num_threads() == 2
    with pytest.raises(ValueError, match="cpu_threads must be a positive integer"):
        EngineConfig(model="m", cpu_threads=0)
