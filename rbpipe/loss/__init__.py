"""The learner's loss: pure formula functions, ``LossConfig``, a torchrl ``GRPOLoss`` subclass and a train step."""

from rbpipe.loss.batch import build_loss_batch, train_step
from rbpipe.loss.config import LossConfig
from rbpipe.loss.functional import aggregate, kl_penalty, policy_loss, rollout_importance_weights
from rbpipe.loss.metrics import MetricsAccumulator
from rbpipe.loss.module import RbpipeGRPOLoss, make_loss

__all__ = ["policy_loss", "kl_penalty", "aggregate", "rollout_importance_weights", "LossConfig", "MetricsAccumulator",
           "RbpipeGRPOLoss", "make_loss", "build_loss_batch", "train_step"]
