"""The drafters, one per module: a draft model (:mod:`.model`), n-gram lookup in the text
(:mod:`.ngram`), suffix matching over everything seen (:mod:`.suffix`) and the target's own
multi-token-prediction layers (:mod:`.mtp`). Each implements
:class:`specgguf.speculative.draft.Drafter`; auto mode weighs each through its arm
(:mod:`specgguf.speculative.arms`)."""

from specgguf.speculative.drafters.model import ModelDrafter
from specgguf.speculative.drafters.mtp import MtpDrafter
from specgguf.speculative.drafters.ngram import LONG_MATCH, NgramDrafter, match_length
from specgguf.speculative.drafters.suffix import SuffixDrafter

__all__ = [
    "LONG_MATCH",
    "ModelDrafter",
    "MtpDrafter",
    "NgramDrafter",
    "SuffixDrafter",
    "match_length",
]
