"""specgguf: speculative decoding for llama.cpp GGUF models.

A small draft model (or n-gram lookup in the text so far) proposes tokens; the large target
model verifies them in one batched forward pass; the longest agreeing prefix is kept, plus
one token from the target. Greedy output is exactly the target's; sampled output keeps the
target's distribution by modified rejection sampling (Leviathan et al. 2023; Chen et al. 2023).
"""

__version__ = "0.1.0"
