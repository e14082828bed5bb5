"""``LossConfig``: one validated object for the whole objective (policy loss, KL, rollout IS, aggregation)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rbpipe.errors import ConfigError
from rbpipe.loss.functional import AGG_ALIASES, AGG_MODES, IS_LEVELS, IS_MODES, KL_KINDS, POLICY_KINDS, validate_bounds

_DEFAULT_EPS = {"grpo": (0.2, 0.2), "dapo": (0.2, 0.28), "cispo": (0.2, 0.28)}
DEFAULT_DUAL_CLIP = 3.0


@dataclass
class LossConfig:
    """Everything the loss computes, validated at construction (a ``ConfigError`` names the option to fix).

    ``eps_low``/``eps_high`` default per objective (grpo 0.2/0.2, dapo and cispo 0.2/0.28); ``dual_clip``
    ``None`` is off, ``True`` means ``c = 3.0``; ``agg_norm`` is the constant of ``seq-mean-token-sum-norm``
    (default: ``max_new_tokens``, the generation budget, which ``RunConfig.loss_config`` always passes; only a
    library caller that gives neither gets the step's max response length); ``rollout_is`` ``None`` disables the
    correction (mismatch metrics are still reported); thresholds and veto are ``(lower, upper)`` with ``lower < upper``.
    """

    loss: str = "grpo"
    eps_low: float | None = None
    eps_high: float | None = None
    dual_clip: float | bool | None = None
    loss_agg_mode: str = "token-mean"
    agg_norm: float | None = None
    max_new_tokens: int | None = None  # the generation budget: agg_norm's default
    kl_type: str = "k3"
    kl_coef: float = 0.0
    rollout_is: str | None = None
    rollout_is_mode: str = "truncate"
    rollout_is_threshold: tuple[float, float] | None = (0.5, 2.0)
    rollout_is_veto: tuple[float, float] | None = None
    entropy_coef: float = 0.0

    @property
    def clip_eps(self) -> tuple[float, float]:
        """``(eps_low, eps_high)`` as resolved by construction (the per-objective defaults: never None)."""
        assert self.eps_low is not None and self.eps_high is not None
        return self.eps_low, self.eps_high

    def __post_init__(self) -> None:
        self.loss_agg_mode = AGG_ALIASES.get(self.loss_agg_mode, self.loss_agg_mode)
        if self.dual_clip is True:
            self.dual_clip = DEFAULT_DUAL_CLIP
        elif self.dual_clip is False:
            self.dual_clip = None
        if self.loss not in POLICY_KINDS:
            raise ConfigError(f"--loss must be one of {', '.join(POLICY_KINDS)}, got {self.loss!r}")
        for name in ("eps_low", "eps_high", "dual_clip", "agg_norm", "kl_coef", "entropy_coef"):
            value = getattr(self, name)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
                raise ConfigError(f"{name} must be a finite number, got {value}")
        if self.max_new_tokens is not None and not self.max_new_tokens >= 1:
            raise ConfigError(f"max_new_tokens (the generation budget) must be >= 1, got {self.max_new_tokens}")
        if self.agg_norm is None and self.max_new_tokens is not None:
            self.agg_norm = float(self.max_new_tokens)
        lo, hi = _DEFAULT_EPS[self.loss]
        self.eps_low = lo if self.eps_low is None else float(self.eps_low)
        self.eps_high = hi if self.eps_high is None else float(self.eps_high)
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ConfigError(f"clip epsilons must satisfy 0 <= eps_low < 1 and eps_high >= 0, got "
                              f"({self.eps_low}, {self.eps_high})")
        if self.dual_clip is not None:
            self.dual_clip = float(self.dual_clip)
            if self.loss == "cispo":
                raise ConfigError("dual-clip applies to the PPO-style objectives (grpo, dapo), not to cispo")
            if self.dual_clip <= 1:
                raise ConfigError(f"dual-clip constant c must be > 1 (typically 3), got {self.dual_clip}")
        if self.loss_agg_mode not in AGG_MODES:
            raise ConfigError(f"--loss-agg-mode must be one of {', '.join(AGG_MODES)}, got {self.loss_agg_mode!r}")
        if self.kl_type not in KL_KINDS:
            raise ConfigError(f"--kl-type must be one of {', '.join(KL_KINDS)}, got {self.kl_type!r}")
        if not self.kl_coef >= 0:
            raise ConfigError(f"--kl-coef must be >= 0, got {self.kl_coef}")
        if not self.entropy_coef >= 0:
            raise ConfigError(f"entropy_coef must be >= 0 (it is a bonus), got {self.entropy_coef}")
        if self.agg_norm is not None and not self.agg_norm > 0:
            raise ConfigError(f"agg_norm (the seq-mean-token-sum-norm constant) must be > 0, got {self.agg_norm}")
        if self.rollout_is is not None and self.rollout_is not in IS_LEVELS:
            raise ConfigError(f"--rollout-is must be one of {', '.join(IS_LEVELS)}, got {self.rollout_is!r}")
        if self.rollout_is_mode not in IS_MODES:
            raise ConfigError(f"--rollout-is-mode must be one of {', '.join(IS_MODES)}, got {self.rollout_is_mode!r}")
        self.rollout_is_threshold = validate_bounds("--rollout-is-threshold", self.rollout_is_threshold)
        self.rollout_is_veto = validate_bounds("--rollout-is-veto", self.rollout_is_veto)
        if self.rollout_is is None and self.rollout_is_veto is not None:
            raise ConfigError("--rollout-is-veto applies only with --rollout-is token|sequence|geometric: add "
                              "--rollout-is or drop the veto")
        if self.rollout_is is not None and self.rollout_is_threshold is None and self.rollout_is_veto is None:
            raise ConfigError("--rollout-is needs --rollout-is-threshold LOWER UPPER (or a veto): without bounds "
                              "the weights are unbounded")
