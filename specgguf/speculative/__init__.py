"""The speculative decoding algorithm, independent of llama.cpp.

- :mod:`.loop`: the draft/verify/accept loop of one generation;
- :mod:`.verification`: the target's evaluation of a draft (chain or tree) and the
  acceptance rules (greedy, sampled, deterministic);
- :mod:`.draft`: what a draft and a drafter are, and what the loop needs from a model;
- :mod:`.drafters`: the drafters, one per module (draft model, n-gram lookup, suffix
  matching);
- :mod:`.planner`: who drafts at each step: a fixed drafter, or auto mode over
  :mod:`.arms` (each drafter as auto mode weighs it) with the cost model of
  :mod:`.costmodel`, the acceptance estimates of :mod:`.estimates`, and every tuning number
  in :mod:`.tuning`;
- :mod:`.sampling` (llama.cpp's sampler chain, modified rejection sampling),
  :mod:`.tree` (token trees), :mod:`.streaming` (text out, stop strings), :mod:`.stats`.

It talks to models only through the ``Evaluator``, ``TargetEvaluator`` and ``Vocabulary``
protocols, so it is tested against a fake backend with exact integer logits; an
import-linter contract keeps it free of llama.cpp, the hub and the faces."""
