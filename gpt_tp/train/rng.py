"""RNGStates (GPTModule.configure_callbacks adds it): every rank's random state in the checkpoint, so a resumed run
draws the dropout masks the uninterrupted run would have drawn (docs/scale.md, "Preemption and requeue")."""

import random

import numpy as np
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn


def rng_state() -> dict:
    """This process's Python, NumPy, torch (and CUDA) generator states, in types torch.load(weights_only=True) takes."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    numpy_state = {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos, "has_gauss": has_gauss,
                   "gauss": gauss}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class RNGStates(Callback):
    """Every rank's state under the checkpoint's "rng_states" (rank 0 writes meta.pt); this rank's is put back at the
    first training batch, after the draws the loop makes on starting."""

    _pending: dict | None = None  # this rank's state, until the first training batch after a resume

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        states = [rng_state()]
        if dist.is_available() and dist.is_initialized():
            states = [None] * dist.get_world_size()
            dist.all_gather_object(states, rng_state())
        checkpoint["rng_states"] = states

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        states = checkpoint.get("rng_states")
        if not states or trainer.state.fn != "fit":  # validate and predict draw nothing to continue
            return
        if len(states) != trainer.world_size:
            rank_zero_warn(f"checkpoint saved on {len(states)} processes, resumed on {trainer.world_size}: "
                           "RNG states not restored")
            return
        self._pending = states[trainer.global_rank]

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if (state := self._pending) is not None:
            random.setstate(state["python"])
            n = state["numpy"]
            np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"]))
            torch.set_rng_state(state["torch"])
            if "cuda" in state and torch.cuda.is_available():
                if len(state["cuda"]) == torch.cuda.device_count():  # a state per visible GPU
                    torch.cuda.set_rng_state_all(state["cuda"])
                else:
                    rank_zero_warn(f"checkpoint saved where {len(state['cuda'])} GPU(s) were visible, resumed where "
                                   f"{torch.cuda.device_count()} are: CUDA RNG states not restored")
            self._pending = None
