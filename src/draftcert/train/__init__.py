"""Training feature drafters by self-distillation (``draftcert train-drafter``).

    from draftcert.train import TrainConfig, train_drafter
    path = train_drafter(TrainConfig(objective="certificate"), "runs/drafter")
"""

from .loop import TrainConfig, train_drafter
from .objective import OBJECTIVES, evaluate, kl_full

__all__ = ["OBJECTIVES", "TrainConfig", "train_drafter", "evaluate", "kl_full"]
