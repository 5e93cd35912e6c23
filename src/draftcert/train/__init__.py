"""Training feature drafters by self-distillation (``draftcert train-drafter``).

    from draftcert.train import TrainConfig, train_drafter
    path = train_drafter(TrainConfig(objective="certificate"), "runs/drafter")
    path = train_drafter(TrainConfig(prompts="sharegpt-train", max_prompt_tokens=256), "runs/sharegpt")
"""

from .loop import TrainConfig, train_drafter
from .objective import OBJECTIVES, evaluate, kl_full
from .user_eval import evaluate_on_user_prompts

__all__ = ["OBJECTIVES", "TrainConfig", "train_drafter", "evaluate", "evaluate_on_user_prompts", "kl_full"]
