import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread_torch():
    # On a loaded 2-core machine torch's intra-op pool thrashes on these tiny ops (20x slower measured).
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
