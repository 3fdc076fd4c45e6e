"""Training draft heads by online distillation from their target (`specrun train-draft`).

prompts.py  built-in prompt splits (broad_prompts.py, train_broad_prompts.py: categorised)
data.py     prompt files, self-distilled responses, batches, the EAGLE-3 draft vocabulary
losses.py   the target pass, the training-time-test unroll and each head kind's loss
heads.py    the head a run starts from: fresh, or a saved one given a new vocabulary or layers
trainer.py  TrainConfig, the training loop, held-out estimate
checkpoint.py  head + optimizer + step under out/checkpoint, the run's sequences beside them
"""

from .data import TrainingSequence
from .trainer import TrainConfig, TrainResult, train_draft

__all__ = ["TrainConfig", "TrainResult", "TrainingSequence", "train_draft"]
