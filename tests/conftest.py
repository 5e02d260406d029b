import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """The test models are tiny: on a 2-core machine a second intra-op thread only contends
    (measured 2-10x slower under load), and one thread makes CPU timings steadier."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
