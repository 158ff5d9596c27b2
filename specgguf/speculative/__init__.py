"""The speculative decoding algorithm, independent of llama.cpp: the draft/verify/accept
loop (:mod:`.loop`), the drafters (:mod:`.drafters`), sampling and the acceptance rules
(:mod:`.sampling`), the cost model and planners that choose the drafter and draft length
(:mod:`.planner`), and streaming detokenization with stop strings (:mod:`.streaming`).

It talks to models only through the ``Evaluator`` and ``Vocabulary`` protocols, so it is
tested against a fake backend with exact integer logits; an import-linter contract keeps
it free of llama.cpp, the hub and the faces."""
