"""Training feature drafters by self-distillation (``draftcert train-drafter``).

    from draftcert.train import TrainConfig, train_drafter
    path = train_drafter(TrainConfig(objective="certificate"), "runs/drafter")
"""

from .loop import OBJECTIVES, TrainConfig, evaluate, kl_full, train_drafter

__all__ = ["OBJECTIVES", "TrainConfig", "train_drafter", "evaluate", "kl_full"]
