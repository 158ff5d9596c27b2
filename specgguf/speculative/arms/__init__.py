"""Auto mode's arms: each drafter as auto mode weighs it (:mod:`.base` for what an arm is
and the generic :class:`ChainArm`; :mod:`.lookup` for n-gram lookup and suffix matching;
:mod:`.model` for the draft model)."""

from specgguf.speculative.arms.base import Arm, ChainArm, Offer, Step, StepPlan
from specgguf.speculative.arms.lookup import LookupArm, Shadow, SuffixArm
from specgguf.speculative.arms.model import ModelArm

__all__ = [
    "Arm", "ChainArm", "LookupArm", "ModelArm", "Offer", "Shadow", "Step", "StepPlan",
    "SuffixArm",
]  # fmt: skip
