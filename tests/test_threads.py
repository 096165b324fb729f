"""one_torch_thread: one thread inside, the caller's count restored after, also on an error."""

import pytest
import torch

from pathir.support.threads import one_torch_thread


def test_restored_after_an_error():
    before = torch.get_num_threads()
    with pytest.raises(ValueError), one_torch_thread():
        assert torch.get_num_threads() == 1
        raise ValueError
    assert torch.get_num_threads() == before
