"""Manifest of the built-in optimizers (torch-free: specs only).

Names are matched case-insensitively, so DeepSpeed's spellings (``Adam``, ``AdamW``, ``OneBitAdam``) and
lower-case ones work. The spec ``"torch"`` is the fallback the engine calls (with a
:class:`dscore.protocols.TorchClassParams` section) for any ``torch.optim`` class not registered here.

Capabilities are declared here and nowhere else: ``zero_supported`` marks DeepSpeed's
ZERO_SUPPORTED_OPTIMIZERS (torch's Adam, AdamW, Adagrad; MuonWithAuxAdam), ``classes`` the exact classes
each factory builds, so a client optimizer of such a class gets the same capabilities.
"""

from __future__ import annotations

from dscore import hookimpl
from dscore.specs import OptimizerSpec

__all__ = ["OPTIMIZER_SPECS", "dscore_register_optimizers"]

_P = "dscore_plugins.optim"
_CFG = f"{_P}.config"

OPTIMIZER_SPECS: tuple[OptimizerSpec, ...] = (
    OptimizerSpec(
        name="adam",
        factory=f"{_P}.adam:build_adam",
        params_model=f"{_CFG}:AdamParams",
        offload_capable=True,
        offload_factory=f"{_P}.adam:build_adam_offload",
        zero_supported=True,
        classes=("torch.optim:AdamW", "torch.optim:Adam"),
        description="Adam; decoupled weight decay unless adam_w_mode=false (DeepSpeed semantics)",
    ),
    OptimizerSpec(
        name="adamw",
        factory=f"{_P}.adam:build_adamw",
        params_model=f"{_CFG}:AdamWParams",
        offload_capable=True,
        offload_factory=f"{_P}.adam:build_adamw_offload",
        zero_supported=True,
        classes=("torch.optim:AdamW",),
        description="AdamW (adam_w_mode forced true)",
    ),
    OptimizerSpec(
        name="lamb",
        factory=f"{_P}.lamb:build_lamb",
        params_model=f"{_CFG}:LambParams",
        classes=(f"{_P}.lamb:Lamb",),
        description="LAMB (FusedLamb semantics)",
    ),
    OptimizerSpec(
        name="lion",
        factory=f"{_P}.lion:build_lion",
        params_model=f"{_CFG}:LionParams",
        classes=(f"{_P}.lion:Lion",),
        description="Lion",
    ),
    OptimizerSpec(
        name="adagrad",
        factory=f"{_P}.torch_optim:build_adagrad",
        params_model=f"{_CFG}:AdagradParams",
        offload_capable=True,
        zero_supported=True,
        classes=("torch.optim:Adagrad",),
        description="torch.optim.Adagrad",
    ),
    OptimizerSpec(
        name="muon",
        factory=f"{_P}.muon:build_muon",
        params_model=f"{_CFG}:MuonParams",
        zero_supported=True,
        classes=(f"{_P}.muon:MuonWithAuxAdam",),
        description="Muon for matrices with an auxiliary AdamW",
    ),
    OptimizerSpec(
        name="onebitadam",
        aliases=("OneBitAdam",),
        factory=f"{_P}.onebit:build_onebit_adam",
        params_model=f"{_CFG}:OneBitAdamParams",
        description="1-bit Adam: error-feedback compressed momentum after freeze_step (dscore addition)",
    ),
    OptimizerSpec(
        name="onebitlamb",
        aliases=("OneBitLamb",),
        factory=f"{_P}.onebit:build_onebit_lamb",
        params_model=f"{_CFG}:OneBitLambParams",
        description="1-bit LAMB: error-feedback compressed momentum after freeze_step (dscore addition)",
    ),
    OptimizerSpec(
        name="sgd",
        factory=f"{_P}.torch_optim:build_sgd",
        params_model=f"{_CFG}:SGDParams",
        classes=("torch.optim:SGD",),
        description="torch.optim.SGD",
    ),
    OptimizerSpec(
        name="torch",
        factory=f"{_P}.torch_optim:torch_optimizer_factory",
        description="fallback: any torch.optim class by name",
    ),
)


@hookimpl
def dscore_register_optimizers() -> tuple[OptimizerSpec, ...]:
    """The built-in optimizers and the ``torch`` fallback."""
    return OPTIMIZER_SPECS
