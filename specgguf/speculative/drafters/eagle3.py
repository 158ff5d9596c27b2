"""Drafting with an EAGLE-3 head (Li et al. 2025, "EAGLE-3: Scaling up Inference
Acceleration of Large Language Models via Training-Time Test"), as llama.cpp's
``--spec-type draft-eagle3`` does (common/speculative.cpp,
``common_speculative_impl_draft_eagle3``).

The head reads the inputs of three of the target's layers at each committed position P,
fused into g_P by its encoder, and its decoder reads (token P + 1, g_P) at position P; a
draft chains its own hidden state in g's place. That is the MTP layers' loop with the
pair's state one position earlier (``backend.Eagle3Head`` keeps the offset), so the
drafter is :class:`~specgguf.speculative.drafters.mtp.MtpDrafter`'s, reading the target's
layer inputs as its hidden states. The head drafts greedily over the target's vocabulary
(a reduced one maps onto it by ``d2t``, the rest never proposed) or samples from its
distribution, which the acceptance rule takes as q.
"""

from __future__ import annotations

from specgguf.speculative.drafters.mtp import MtpDrafter


class Eagle3Drafter(MtpDrafter):
    """Drafts up to K tokens per step with an EAGLE-3 head, one decoder evaluation per
    draft token (see the module; the arguments are :class:`MtpDrafter`'s: the head's
    context, the target's context keeping the layers' inputs, the target's vocabulary
    size)."""

    name = "eagle3"
    keep_seed = True
