"""The checkpoint room (docs/structure.md): distributed checkpoints saved, checked, loaded and exported. The configs
name ModelParallel and AtomicModelCheckpoint here."""

from gpt_tp.checkpoint.contents import Contents, load_consolidated, read_contents  # noqa: F401
from gpt_tp.checkpoint.last import FinalStep, latest_checkpoint  # noqa: F401
from gpt_tp.checkpoint.lightning_internals import AtomicModelCheckpoint  # noqa: F401
from gpt_tp.checkpoint.store import CheckpointError, check_checkpoint, recover_interrupted_saves  # noqa: F401
from gpt_tp.checkpoint.strategy import ModelParallel  # noqa: F401
