"""Drafting with Gemma 4's multi-token-prediction assistant, a model of its own given as
``-md``, as llama.cpp's ``--spec-type draft-mtp`` drafts with it (common/speculative.cpp,
``common_speculative_impl_draft_mtp`` with its memory shared with the target's).

The assistant has no KV cache of its own: its blocks attend over the target's. Its first
row of a step reads the last committed token with the target's hidden state after the
position before it, each further row the token it just drafted with its own hidden state
(projected back to the target's width), all at the step's first draft position. That is
the MTP layers' loop (:class:`~specgguf.speculative.drafters.mtp.MtpDrafter`), with a head
(``backend.AssistantHead``) that decodes only the rows a draft needs.
"""

from __future__ import annotations

from specgguf.speculative.drafters.mtp import MtpDrafter


class AssistantDrafter(MtpDrafter):
    """Drafts up to K tokens per step with an MTP assistant, one evaluation per draft token
    (the arguments are :class:`MtpDrafter`'s: the assistant's context, the target's context
    keeping its hidden states, the target's vocabulary size)."""

    name = "assistant"
