"""RNGStates on resume: a checkpoint's CUDA generator states are put back only where as many GPUs are visible."""

from types import SimpleNamespace

import pytest
import torch

from gpt_tp.train.rng import RNGStates, rng_state


@pytest.mark.parametrize("saved,visible", [(8, 2), (2, 2)])
def test_cuda_states_of_another_gpu_count_are_one_line_not_a_crash(monkeypatch, saved, visible):
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", restored.append)  # the real one: IndexError past device 1
    state = {**rng_state(), "cuda": [torch.zeros(16, dtype=torch.uint8)] * saved}
    callback = RNGStates()
    trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"), world_size=1, global_rank=0)
    callback.on_load_checkpoint(trainer, None, {"rng_states": [state]})
    if saved == visible:
        callback.on_train_batch_start(trainer, None, None, 0)
        assert restored == [state["cuda"]]
        return
    with pytest.warns(UserWarning) as caught:
        callback.on_train_batch_start(trainer, None, None, 0)
    assert restored == [] and len(caught) == 1
    assert str(caught[0].message) == ("checkpoint saved where 8 GPU(s) were visible, resumed where 2 are: CUDA RNG "
                                      "states not restored")
