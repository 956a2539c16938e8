"""Pydantic models of ``optimizer.params`` for the built-in optimizers (torch-free).

Keys and defaults mirror DeepSpeed 0.19.8 (``deepspeed-behaviour.md`` §4): FusedAdam/CPUAdam for
adam/adamw, FusedLamb, FusedLion, torch Adagrad, MuonWithAuxAdam and the (0.19.8-removed, dscore-kept)
OnebitAdam/OnebitLamb. Every model rejects unknown keys, and ``max_grad_norm`` with DeepSpeed's pointer
to ``gradient_clipping``.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, model_validator

from dscore.config.base import Float, NonNegativeFloat, NonNegativeInt, PositiveFloat, PositiveInt

__all__ = [
    "OptimizerParams",
    "AdamFamilyParams",
    "AdamParams",
    "AdamWParams",
    "LambParams",
    "LionParams",
    "AdagradParams",
    "MuonParams",
    "SGDParams",
    "OneBitAdamParams",
    "OneBitLambParams",
]

Betas = tuple[Annotated[Float, Field(ge=0, lt=1)], Annotated[Float, Field(ge=0, lt=1)]]


class OptimizerParams(BaseModel):
    """Base: unknown keys are errors; ``max_grad_norm`` is refused as DeepSpeed refuses it."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _no_max_grad_norm(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_grad_norm" in data:
            raise ValueError(
                "'max_grad_norm' is not supported as an optimizer parameter; use the top-level ds_config key "
                "'gradient_clipping' instead"
            )
        return data


class AdamFamilyParams(OptimizerParams):
    """The hyper-parameters every Adam-style optimizer shares (Adam, AdamW, CPU Adam, FusedAdam, LAMB), with
    DeepSpeed's defaults written once; each optimizer's model adds its own keys."""

    lr: NonNegativeFloat = 1e-3
    """Learning rate."""
    bias_correction: StrictBool = True
    """Divide the moments by ``1 - beta^t``."""
    betas: Betas = (0.9, 0.999)
    """Coefficients of the running averages of the gradient and its square."""
    eps: PositiveFloat = 1e-8
    """Added to the denominator."""
    weight_decay: NonNegativeFloat = 0.0
    """Weight decay (decoupled or L2 as the optimizer's mode says)."""


class AdamParams(AdamFamilyParams):
    """``Adam``: decoupled weight decay by default (``adam_w_mode`` true), as DeepSpeed's FusedAdam.

    Defaults are FusedAdam's / DeepSpeedCPUAdam's; with ``torch_adam: true`` keys not given take torch's own
    defaults instead (``weight_decay`` 0.01 for AdamW), as DeepSpeed passes only the given keys there.
    """

    amsgrad: StrictBool = False
    """Use the AMSGrad maximum of second moments."""
    adam_w_mode: StrictBool = True
    """Decoupled weight decay (AdamW). DeepSpeed's default is true even for ``"type": "Adam"``."""
    torch_adam: StrictBool = False
    """Use ``torch.optim.Adam``/``AdamW`` (for-each) instead of the fused kernel."""
    set_grad_none: StrictBool = True
    """Accepted for FusedAdam compatibility (dscore's engine always sets ``grad = None``)."""
    fp32_optimizer_states: StrictBool = True
    """Accepted for DeepSpeedCPUAdam compatibility (states are always fp32 here)."""
    foreach: StrictBool | None = None
    """``torch_adam`` only: torch's ``foreach`` argument, passed through as DeepSpeed passes it. Unset,
    dscore asks for the for-each implementation (DeepSpeed leaves torch's default, which on CPU is the
    slower per-parameter loop)."""
    fused: StrictBool | None = None
    """``torch_adam`` only: torch's ``fused`` argument, passed through as DeepSpeed passes it."""

    @model_validator(mode="after")
    def _torch_only_keys(self) -> AdamParams:
        given = [k for k in ("foreach", "fused") if getattr(self, k) is not None]
        if given and not self.torch_adam:
            raise ValueError(
                f"{' and '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with torch_adam: true "
                "(torch.optim.Adam/AdamW arguments; "
                "DeepSpeed's fused Adam does not take them); set torch_adam: true or remove them"
            )
        if self.foreach and self.fused:
            raise ValueError("foreach and fused cannot both be true (torch runs one implementation); pick one")
        return self


class AdamWParams(AdamParams):
    """``AdamW``: as ``Adam`` with ``adam_w_mode`` forced true (a false value is overridden, as DeepSpeed)."""


class LambParams(AdamFamilyParams):
    """``Lamb`` (You et al., arXiv:1904.00962) as DeepSpeed's FusedLamb (``weight_decay`` is added to the
    update before the trust ratio)."""

    eps_inside_sqrt: StrictBool = False
    """``sqrt(v + eps)`` instead of ``sqrt(v) + eps``."""
    max_coeff: PositiveFloat = 10.0
    """Upper clamp of the trust ratio."""
    min_coeff: NonNegativeFloat = 0.01
    """Lower clamp of the trust ratio."""
    amsgrad: Literal[False] = False
    """Not supported (as FusedLamb)."""


class LionParams(OptimizerParams):
    """``Lion`` (Chen et al., arXiv:2302.06675) as DeepSpeed's FusedLion."""

    lr: NonNegativeFloat = 1e-3
    """Learning rate."""
    betas: Betas = (0.9, 0.999)
    """Interpolation (beta1) and momentum (beta2) coefficients."""
    weight_decay: NonNegativeFloat = 0.0
    """Decoupled weight decay."""


class AdagradParams(OptimizerParams):
    """``Adagrad`` (``torch.optim.Adagrad``; DeepSpeed defaults lr=1e-2, eps=1e-10)."""

    lr: NonNegativeFloat = 1e-2
    """Learning rate."""
    lr_decay: NonNegativeFloat = 0.0
    """Learning-rate decay."""
    weight_decay: NonNegativeFloat = 0.0
    """L2 penalty."""
    initial_accumulator_value: NonNegativeFloat = 0.0
    """Initial sum of squares."""
    eps: PositiveFloat = 1e-10
    """Denominator term."""


class MuonParams(OptimizerParams):
    """``Muon`` with an auxiliary Adam (Jordan et al. 2024), DeepSpeed's MuonWithAuxAdam keys."""

    lr: NonNegativeFloat | None = None
    """Default for ``muon_lr`` and ``adam_lr``; None: 0.02 for Muon and 3e-4 for the auxiliary Adam
    (DeepSpeed's MuonWithAuxAdam defaults)."""
    muon_lr: NonNegativeFloat | None = None
    """Learning rate of the Muon (matrix) parameters; None takes ``lr`` (else 0.02)."""
    adam_lr: NonNegativeFloat | None = None
    """Learning rate of the auxiliary Adam parameters; None takes ``lr`` (else 3e-4)."""
    momentum: Annotated[Float, Field(ge=0, lt=1)] = 0.95
    """Muon momentum."""
    nesterov: StrictBool = True
    """Nesterov-style momentum for Muon."""
    ns_steps: PositiveInt = 5
    """Newton-Schulz iterations."""
    ns_method: Literal["newton_schulz"] = "newton_schulz"
    """Orthogonalisation method (only the quintic Newton-Schulz iteration is implemented)."""
    per_head_muon: Literal[False] = False
    """Per-attention-head orthogonalisation: not implemented in dscore."""
    betas: Betas = (0.9, 0.95)
    """Auxiliary Adam moment coefficients."""
    eps: PositiveFloat = 1e-10
    """Auxiliary Adam denominator term."""
    weight_decay: NonNegativeFloat = 0.0
    """Decoupled weight decay (both parts)."""

    #: per-half learning rates when none of ``lr`` / ``muon_lr`` / ``adam_lr`` is given (DeepSpeed 0.19.8's
    #: MuonWithAuxAdam defaults)
    MUON_LR_DEFAULT: ClassVar[float] = 0.02
    AUX_ADAM_LR_DEFAULT: ClassVar[float] = 3e-4

    def resolved_lrs(self) -> tuple[float, float]:
        """``(muon_lr, adam_lr)``: each half's own key, else ``lr``, else its DeepSpeed default."""
        muon = self.muon_lr if self.muon_lr is not None else self.lr if self.lr is not None else self.MUON_LR_DEFAULT
        adam = self.adam_lr if self.adam_lr is not None else self.lr if self.lr is not None else self.AUX_ADAM_LR_DEFAULT
        return float(muon), float(adam)


class SGDParams(OptimizerParams):
    """``SGD`` (``torch.optim.SGD``)."""

    lr: NonNegativeFloat = 1e-3
    """Learning rate."""
    momentum: NonNegativeFloat = 0.0
    """Momentum factor."""
    dampening: NonNegativeFloat = 0.0
    """Momentum dampening."""
    weight_decay: NonNegativeFloat = 0.0
    """L2 penalty."""
    nesterov: StrictBool = False
    """Nesterov momentum."""
    maximize: StrictBool = False
    """Maximise the objective."""


class OneBitAdamParams(OptimizerParams):
    """``OneBitAdam`` (Tang et al., arXiv:2102.02888); a dscore addition (removed from DeepSpeed 0.19.8)."""

    lr: NonNegativeFloat = 1e-3
    """Learning rate."""
    freeze_step: NonNegativeInt = 100000
    """Warm-up steps of exact Adam before the variance is frozen and momentum is 1-bit compressed."""
    bias_correction: StrictBool = True
    """Accepted for DeepSpeed compatibility (OnebitAdam applies no bias correction)."""
    betas: Betas = (0.9, 0.999)
    """Moment coefficients."""
    eps: PositiveFloat = 1e-8
    """Denominator term."""
    eps_inside_sqrt: StrictBool = False
    """``sqrt(v + eps)`` instead of ``sqrt(v) + eps``."""
    weight_decay: NonNegativeFloat = 0.0
    """Added to the update (L2-style, as OnebitAdam)."""
    amsgrad: Literal[False] = False
    """Not supported."""
    cuda_aware: StrictBool = False
    """Accepted for compatibility; dscore always communicates through torch.distributed."""
    comm_backend_name: str = "nccl"
    """Accepted for compatibility; dscore uses the default process group's backend."""


class OneBitLambParams(OneBitAdamParams):
    """``OneBitLamb`` (Li et al., arXiv:2104.06069); a dscore addition (removed from DeepSpeed 0.19.8)."""

    max_coeff: PositiveFloat = 10.0
    """Upper clamp of the trust ratio during warm-up."""
    min_coeff: NonNegativeFloat = 0.01
    """Lower clamp of the trust ratio during warm-up."""
    coeff_beta: Annotated[Float, Field(ge=0, lt=1)] = 0.9
    """EMA coefficient of the trust ratio frozen at ``freeze_step``."""
    factor_max: PositiveFloat = 4.0
    """Upper clamp of the compression-stage scaling factor."""
    factor_min: PositiveFloat = 0.5
    """Lower clamp of the compression-stage scaling factor."""
    factor_threshold: NonNegativeFloat = 0.1
    """Largest relative change of the scaling factor per step."""
