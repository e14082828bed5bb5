"""The learner's loss (``LOSS_SPEC``): pure formula functions, ``LossConfig``, torchrl ``GRPOLoss`` subclasses
(GRPO / DAPO / CISPO with rollout IS, KL to a reference and exact micro-batch metrics) and a train step."""

from rbpipe.loss.batch import build_loss_batch, step_counts, train_step
from rbpipe.loss.config import LossConfig
from rbpipe.loss.functional import aggregate, kl_penalty, policy_loss, rollout_importance_weights, train_policy_metrics
from rbpipe.loss.metrics import MetricsAccumulator
from rbpipe.loss.module import (
    LOSS_CLASSES,
    REF_KEY,
    ROLLOUT_FULL_KEY,
    LossInputError,
    RbpipeCISPOLoss,
    RbpipeDAPOLoss,
    RbpipeGRPOLoss,
    make_loss,
    one_update_loss,
)

__all__ = ["policy_loss", "kl_penalty", "aggregate", "rollout_importance_weights", "train_policy_metrics",
           "LossConfig", "MetricsAccumulator", "RbpipeGRPOLoss", "RbpipeDAPOLoss", "RbpipeCISPOLoss",
           "LOSS_CLASSES", "LossInputError", "make_loss", "one_update_loss", "build_loss_batch", "step_counts",
           "train_step", "REF_KEY", "ROLLOUT_FULL_KEY"]
