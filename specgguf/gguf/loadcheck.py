"""What llama.cpp's model loader refuses, found from a GGUF file's metadata and tensor
directory alone, before any weights load.

:meth:`GGUFMetadata.open <specgguf.gguf.metadata.GGUFMetadata.open>` already refuses what
llama.cpp's GGUF reader refuses. A file that passes it can still be refused when llama.cpp
builds a model from it; :func:`load_findings` mirrors those checks, in llama.cpp's order
(llama-cpp-python 0.3.36, vendor/llama.cpp/src):

``llama_model_loader::llama_model_loader`` (llama-model-loader.cpp)
    keys read with a fixed type (``GGUFMeta::GKV::get_kv``: ``general.architecture``
    string, ``general.file_type`` uint32, ``split.count``/``split.no`` uint16,
    ``split.tensors.count`` int32); every tensor's data inside its file
    (``llama_tensor_weight``); a split model: a first-shard name ending in
    ``-00001-of-0000N.gguf`` (``llama_split_prefix``), every shard present with
    ``split.no`` equal to its index, no tensor name in two shards, ``split.tensors.count``
    equal to the tensors found.
``llama_model_create`` (llama-model.cpp), ``llama_model_load`` (llama.cpp)
    an architecture llama.cpp builds a model for (``LLM_ARCH_NAMES`` in llama-arch.cpp,
    less ``gptj``, which ``llama_model_mapping`` lacks), not ``clip``.
``llama_model_base::load_hparams`` (llama-model.cpp)
    ``{arch}.context_length``, ``embedding_length`` and ``block_count`` present; the
    hyperparameters it reads with their GGUF types; per-layer arrays as long as
    ``block_count``; the ``GGML_ASSERT`` s that end the process: ``block_count`` in
    1..512, expert counts consistent, a known ``rope.scaling.type``; for llama, deci,
    falcon and llama-embed, ``rope.dimension_count`` equal to the head size.
``load_arch_hparams`` and ``load_arch_tensors`` (src/models/*.cpp), for the architectures
in :data:`ARCH_TENSORS` only (llama, qwen2, qwen3, gemma3)
    ``{arch}.attention.layer_norm_rms_epsilon`` present (a float32; for llama,
    ``vocab_size`` a uint32); the tensors created without
    ``TENSOR_NOT_REQUIRED`` present; ``token_embd``, ``output_norm`` and ``output`` of the
    shape llama.cpp expects.

The vocabulary's own rules (``llama_vocab::impl::load``) are in :mod:`specgguf.gguf.vocab`
and are merged in by :func:`load_findings`. Not mirrored: the other architectures'
required keys and tensors (about 150 ``load_arch_*`` functions), every tensor's shape
beyond the three named, tensors a file has but llama.cpp does not use ("wrong number of
tensors"), and anything decided by the tensor data itself.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from specgguf.gguf.metadata import Finding, GGUFMetadata, Severity, TensorInfo, shown

#: Architectures llama.cpp builds a model for: named in ``LLM_ARCH_NAMES``
#: (src/llama-arch.cpp) and handled by ``llama_model_mapping`` (src/llama-model.cpp), which
#: leaves out ``gptj``.
LLAMA_ARCHS = frozenset({
    "clip", "llama", "llama4", "deci", "falcon", "grok", "gpt2", "gptneox", "mpt",
    "baichuan", "starcoder", "refact", "bert", "modern-bert", "nomic-bert", "nomic-bert-moe",
    "neo-bert", "jina-bert-v2", "jina-bert-v3", "eurobert", "bloom", "stablelm", "qwen",
    "qwen2", "qwen2moe", "qwen2vl", "qwen3", "qwen3moe", "qwen3next", "qwen3vl",
    "qwen3vlmoe", "qwen35", "qwen35moe", "qwen4exp", "phi2", "phi3", "phimoe", "plamo",
    "plamo2", "plamo3", "codeshell", "orion", "internlm2", "minicpm", "minicpm3", "gemma",
    "gemma2", "gemma3", "gemma3n", "gemma4", "gemma4-assistant", "gemma-embedding",
    "starcoder2", "mamba", "mamba2", "maple", "jamba", "falcon-h1", "xverse", "command-r",
    "cohere2", "cohere2moe", "dbrx", "olmo", "olmo2", "olmoe", "muse-glimmer", "openelm",
    "arctic", "deepseek", "deepseek2", "deepseek2-ocr", "deepseek32", "deepseek4", "chatglm",
    "glm4", "glm4moe", "glm-dsa", "bitnet", "t5", "t5encoder", "jais", "jais2", "nemotron",
    "nemotron_h", "nemotron_h_moe", "exaone", "exaone4", "exaone-moe", "rwkv6", "rwkv6qwen2",
    "rwkv7", "arwkv7", "granite", "granitemoe", "granitehybrid", "graniteswitch",
    "granite_swa", "chameleon", "wavtokenizer-dec", "plm", "bailingmoe", "bailingmoe2",
    "bailingmoe3", "dots1", "dots3note", "arcee", "afmoe", "laguna", "ernie4_5",
    "ernie4_5-moe", "hunyuan-moe", "hunyuan-dense", "hunyuan_vl", "hy_v3", "hy_v4", "smollm3",
    "gpt-oss", "lfm2", "lfm2moe", "dream", "smallthinker", "llada", "llada-moe", "seed_oss",
    "grovemoe", "apertus", "minimax-01", "hrm_text", "minimax-m2", "minimax-m3", "cogvlm",
    "rnd1", "pangu-embedded", "mistral3", "eagle3", "dflash", "mistral4", "paddleocr",
    "mimo2", "step35", "spark2_5", "llama-embed", "maincoder", "kimi-linear", "kimi-k3",
    "glm5-next", "talkie", "mellum", "nanbeige", "qwen3tts", "pockettts",
})  # fmt: skip

#: ``LLAMA_MAX_LAYERS`` and ``LLAMA_MAX_EXPERTS`` (src/llama-hparams.h).
LLAMA_MAX_LAYERS = 512
LLAMA_MAX_EXPERTS = 1024

#: ``LLAMA_ROPE_SCALING_TYPES`` (src/llama-model.cpp).
ROPE_SCALING_TYPES = frozenset({"none", "linear", "yarn", "longrope"})

# Keys llama.cpp reads with ``get_key`` (the stored type must be exactly this one);
# ``{a}`` is the architecture. The vocabulary's keys are in specgguf.gguf.vocab.
_LOADER_KEYS = {
    "general.architecture": "string",
    "general.file_type": "uint32",
    "split.count": "uint16",
}
_HPARAM_KEYS = {
    "general.name": "string",
    "{a}.context_length": "uint32",
    "{a}.embedding_length": "uint32",
    "{a}.embedding_length_out": "uint32",
    "{a}.attention.causal": "bool",
    "{a}.pooling_type": "uint32",
    "{a}.classifier.pooling_type": "uint32",
    "{a}.block_count": "uint32",
    "{a}.nextn_predict_layers": "uint32",
    "{a}.expert_count": "uint32",
    "{a}.expert_group_count": "uint32",
    "{a}.expert_group_used_count": "uint32",
    "{a}.rope.scaling.finetuned": "bool",
    "{a}.rope.scaling.original_context_length": "uint32",
    "{a}.rope.freq_base": "float32",
    "{a}.rope.scaling.type": "string",
    "{a}.rope.scaling.factor": "float32",
    "{a}.rope.scale_linear": "float32",
    "{a}.rope.scaling.attn_factor": "float32",
    "{a}.rope.scaling.alpha": "float32",
    "{a}.rope.dimension_count": "uint32",
    "{a}.attention.key_length": "uint32",
    "{a}.attention.value_length": "uint32",
}
_REQUIRED_HPARAMS = ("{a}.context_length", "{a}.embedding_length", "{a}.block_count")
# Read with get_key_or_arr: a uint32, or an array of block_count uint32/int32/bool.
_PER_LAYER_KEYS = (
    "{a}.expert_used_count",
    "{a}.feed_forward_length",
    "{a}.attention.head_count",
    "{a}.attention.head_count_kv",
)
_PER_LAYER_ARRAY_TYPES = frozenset({"array[uint32]", "array[int32]", "array[bool]"})
# Architectures whose rope.dimension_count must equal the head size (load_hparams).
_N_ROT_ARCHS = frozenset({"llama", "deci", "falcon", "llama-embed"})


def _llama_tensors(n_layer: int, n_expert: int) -> list[tuple[str, ...]]:
    """llama_model_llama::load_arch_tensors (src/models/llama.cpp): the required tensors,
    each as a tuple of alternatives (fused QKV or separate Q, K, V)."""
    out: list[tuple[str, ...]] = [("token_embd.weight",), ("output_norm.weight",)]
    for i in range(n_layer):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight",), *_qkv(b), (b + "attn_output.weight",),
                (b + "ffn_norm.weight",)]  # fmt: skip
        if n_expert == 0:
            out += [(b + "ffn_gate.weight",), (b + "ffn_down.weight",), (b + "ffn_up.weight",)]
        else:
            out += [(b + "ffn_gate_inp.weight",), (b + "ffn_down_exps.weight",),
                    (b + "ffn_up_exps.weight",)]  # fmt: skip
    return out


def _qkv(b: str) -> list[tuple[str, ...]]:
    """create_tensor_qkv (src/llama-model.cpp): ``attn_qkv`` or all of ``attn_q/k/v``."""
    fused = b + "attn_qkv.weight"
    return [
        (fused, b + "attn_q.weight"),
        (fused, b + "attn_k.weight"),
        (fused, b + "attn_v.weight"),
    ]


def _qwen2_tensors(n_layer: int, n_expert: int) -> list[tuple[str, ...]]:
    """src/models/qwen2.cpp (no experts)."""
    return _llama_tensors(n_layer, 0)


def _qwen3_tensors(n_layer: int, n_expert: int) -> list[tuple[str, ...]]:
    """src/models/qwen3.cpp: llama's, and Q/K norms."""
    out = _llama_tensors(n_layer, 0)
    for i in range(n_layer):
        out += [(f"blk.{i}.attn_q_norm.weight",), (f"blk.{i}.attn_k_norm.weight",)]
    return out


def _gemma3_tensors(n_layer: int, n_expert: int) -> list[tuple[str, ...]]:
    """src/models/gemma3.cpp: qwen3's, and post-attention and post-FFN norms."""
    out = _qwen3_tensors(n_layer, 0)
    for i in range(n_layer):
        out += [(f"blk.{i}.post_attention_norm.weight",), (f"blk.{i}.post_ffw_norm.weight",)]
    return out


#: Architecture -> its required tensors (alternatives per entry), given block_count and
#: expert_count. Each of these also requires ``{arch}.attention.layer_norm_rms_epsilon``.
ARCH_TENSORS: dict[str, Callable[[int, int], list[tuple[str, ...]]]] = {
    "llama": _llama_tensors,
    "qwen2": _qwen2_tensors,
    "qwen3": _qwen3_tensors,
    "gemma3": _gemma3_tensors,
}


class _Findings(list[Finding]):
    def add(self, severity: Severity, code: str, message: str) -> None:
        self.append(Finding(severity, code, message))


def load_findings(meta: GGUFMetadata, vocab: Sequence[Finding] = ()) -> list[Finding]:
    """What llama.cpp would refuse (``error``) or warn about (``warning``) when loading the
    model whose first file is ``meta`` (for a split model, the shards next to it are
    opened too), with the vocabulary's findings ``vocab`` placed where llama.cpp checks the
    vocabulary (after the hyperparameters, before the tensors).

    Raises:
        GGUFFormatError: a shard of a split model is not a readable GGUF file.
    """
    out = _Findings()
    _check_key_types(meta, _LOADER_KEYS, "", out)
    tensors = _check_files(meta, out)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        out.add("error", "architecture", "no general.architecture: llama.cpp needs one")
        return [*out, *vocab]
    if arch not in LLAMA_ARCHS:
        out.add(
            "error",
            "architecture",
            f"unknown architecture {shown(arch, quote=True)}: this llama.cpp build cannot load it",
        )
        return [*out, *vocab]
    if arch == "clip":
        out.add(
            "error", "architecture",
            "a multimodal projector (clip): it reads images or audio for a language model, and is "
            "not one",
        )  # fmt: skip
        return [*out, *vocab]
    hparams_ok = _check_hparams(meta, arch, out)
    out.extend(vocab)
    if hparams_ok and arch in ARCH_TENSORS:
        _check_tensors(meta, arch, tensors, out)
    return list(out)


def _check_key_types(meta: GGUFMetadata, keys: dict[str, str], arch: str, out: _Findings) -> None:
    for pattern, want in keys.items():
        key = pattern.format(a=arch)
        have = meta.kv_types.get(key)
        if have is not None and have != want:
            out.add(
                "error",
                "key-type",
                f"{key} is {have}; llama.cpp reads it as {want} and refuses the file",
            )


def _uint(meta: GGUFMetadata, key: str, type_name: str = "uint32") -> int | None:
    """A key's value when it has the type llama.cpp reads it with, else None."""
    if meta.kv_types.get(key) != type_name:
        return None
    v = meta.get(key)
    return int(v)


def _check_files(meta: GGUFMetadata, out: _Findings) -> list[TensorInfo]:
    """Tensor data inside each file, and a split model's shards (llama_model_loader).
    Returns the tensors of every file read."""
    tensors = list(meta.tensors())
    _check_bounds(meta, out)
    n_split = _uint(meta, "split.count", "uint16") or 0
    if n_split <= 1:
        return tensors
    if "split.no" not in meta.kv:
        out.add("error", "split", "a split model (split.count > 1) without split.no")
        return tensors
    if meta.kv_types["split.no"] != "uint16":
        _check_key_types(meta, {"split.no": "uint16"}, "", out)
        return tensors
    idx = int(meta.get("split.no"))
    if idx != 0:
        out.add(
            "error",
            "split",
            f"this is shard {idx + 1} of {n_split}; llama.cpp loads a split model from "
            "its first shard",
        )
        return tensors
    postfix = f"-00001-of-{n_split:05d}.gguf"
    whole = str(meta.path)
    if not whole.endswith(postfix) or len(whole) <= len(postfix):
        out.add(
            "error",
            "split",
            f"a split model's first shard must be named *{postfix} (split.count is "
            f"{n_split}); llama.cpp cannot find the other shards",
        )
        return tensors
    prefix = whole[: -len(postfix)]
    names = {t.name for t in tensors}
    for i in range(1, n_split):
        shard = Path(f"{prefix}-{i + 1:05d}-of-{n_split:05d}.gguf")
        if not shard.is_file():
            out.add("error", "split", f"shard {i + 1} of {n_split} is missing: {shard}")
            return tensors
        with GGUFMetadata.open(shard) as sm:
            if "split.no" not in sm.kv:
                out.add("error", "split", f"{shard.name} has no split.no")
                return tensors
            if sm.kv_types["split.no"] != "uint16":
                out.add(
                    "error",
                    "key-type",
                    f"{shard.name}: split.no is {sm.kv_types['split.no']}; llama.cpp "
                    "reads it as uint16 (and aborts)",
                )
                return tensors
            if int(sm.get("split.no")) != i:
                out.add(
                    "error",
                    "split",
                    f"{shard.name} says it is shard {int(sm.get('split.no')) + 1}, "
                    f"expected {i + 1}",
                )
                return tensors
            for t in sm.tensors():
                if t.name in names:
                    out.add(
                        "error",
                        "split",
                        f"tensor {t.name!r} is in two shards (again in {shard.name})",
                    )
                    return tensors
                names.add(t.name)
            tensors += sm.tensors()
            _check_bounds(sm, out)
    if "split.tensors.count" not in meta.kv:
        out.add("error", "split", "a split model without split.tensors.count")
    elif meta.kv_types["split.tensors.count"] != "int32":
        _check_key_types(meta, {"split.tensors.count": "int32"}, "", out)
    elif int(meta.get("split.tensors.count")) != len(tensors):
        out.add(
            "error",
            "split",
            f"split.tensors.count is {meta.get('split.tensors.count'):,} but the shards "
            f"hold {len(tensors):,} tensors",
        )
    return tensors


def _check_bounds(meta: GGUFMetadata, out: _Findings) -> None:
    """Every tensor's data inside the file (``llama_tensor_weight``): the first one past
    the end is reported (the file is truncated, or the download incomplete)."""
    for t in meta.tensors():
        end = meta.data_offset + t.offset + t.n_bytes
        if end > meta.file_size:
            out.add(
                "error",
                "truncated",
                f"{meta.path.name}: tensor {t.name!r} ends at byte {end:,}, past the end "
                f"of the file ({meta.file_size:,} bytes): truncated or incomplete",
            )
            return


def _per_layer(meta: GGUFMetadata, key: str, n_layer: int, out: _Findings) -> list[int] | None:
    """A get_key_or_arr key: its values per layer, or None (absent or refused)."""
    have = meta.kv_types.get(key)
    if have is None:
        return None
    if have == "uint32":
        return [int(meta.get(key))] * max(n_layer, 1)
    if not have.startswith("array["):
        out.add(
            "error", "key-type", f"{key} is {have}; llama.cpp reads a uint32 or an array of them"
        )
        return None
    ref = meta.get(key)
    if ref.count != n_layer:
        out.add(
            "error",
            "key-type",
            f"{key} has {ref.count:,} values; llama.cpp needs one per layer ({n_layer})",
        )
        return None
    if have not in _PER_LAYER_ARRAY_TYPES:
        out.add(
            "error",
            "key-type",
            f"{key} is {have}; llama.cpp reads an array of uint32, int32 or bool",
        )
        return None
    return [int(v) for v in meta.numbers(ref)]


def _check_hparams(meta: GGUFMetadata, arch: str, out: _Findings) -> bool:
    """load_hparams (src/llama-model.cpp) and, for ARCH_TENSORS, load_arch_hparams.
    Returns whether the hyperparameters the tensor checks need are sound."""
    n_before = len(out)
    _check_key_types(meta, _HPARAM_KEYS, arch, out)
    for pattern in _REQUIRED_HPARAMS:
        key = pattern.format(a=arch)
        if key not in meta.kv:
            out.add("error", "missing-key", f"{key} is missing; llama.cpp needs it")
    n_layer = _uint(meta, f"{arch}.block_count")
    if n_layer is not None and not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        out.add(
            "error",
            "block-count",
            f"{arch}.block_count is {n_layer}; llama.cpp aborts outside 1..{LLAMA_MAX_LAYERS}",
        )
    if n_layer is None or not 1 <= n_layer <= LLAMA_MAX_LAYERS:
        return False
    n_nextn = _uint(meta, f"{arch}.nextn_predict_layers") or 0
    if n_nextn > n_layer:
        out.add(
            "error",
            "block-count",
            f"{arch}.nextn_predict_layers ({n_nextn}) exceeds block_count ({n_layer}); "
            "llama.cpp aborts",
        )
    per_layer = {p: _per_layer(meta, p.format(a=arch), n_layer, out) for p in _PER_LAYER_KEYS}
    _check_experts(meta, arch, per_layer["{a}.expert_used_count"], out)
    scaling = meta.get(f"{arch}.rope.scaling.type")
    if isinstance(scaling, str) and scaling not in ROPE_SCALING_TYPES:
        out.add(
            "error",
            "rope-scaling",
            f"{arch}.rope.scaling.type is {shown(scaling, quote=True)}; llama.cpp knows "
            f"{', '.join(sorted(ROPE_SCALING_TYPES))} and aborts on others",
        )
    heads = per_layer["{a}.attention.head_count"]
    n_embd = _uint(meta, f"{arch}.embedding_length")
    if arch in _N_ROT_ARCHS and heads and heads[0] > 0 and n_embd is not None:
        head_k = _uint(meta, f"{arch}.attention.key_length")
        head_k = n_embd // heads[0] if head_k is None else head_k
        n_rot = _uint(meta, f"{arch}.rope.dimension_count")
        if n_rot is not None and n_rot != head_k:
            out.add(
                "error",
                "rope-dimension",
                f"{arch}.rope.dimension_count is {n_rot}; llama.cpp requires the head "
                f"size, {head_k}",
            )
    if arch in ARCH_TENSORS:
        key = f"{arch}.attention.layer_norm_rms_epsilon"
        if key not in meta.kv:
            out.add("error", "missing-key", f"{key} is missing; llama.cpp needs it")
        else:
            _check_key_types(meta, {key: "float32"}, arch, out)
    if arch == "llama":  # llama_model_llama::load_arch_hparams reads it as uint32
        _check_key_types(meta, {"{a}.vocab_size": "uint32"}, arch, out)
    return len(out) == n_before


def _check_experts(meta: GGUFMetadata, arch: str, used: list[int] | None, out: _Findings) -> None:
    """The expert-count GGML_ASSERTs of load_hparams (each ends the process)."""
    n_expert = _uint(meta, f"{arch}.expert_count") or 0
    if arch in ("hunyuan_vl", "hunyuan-dense") and n_expert <= 1:
        n_expert, used = 0, None
    used_max = max(used) if used else 0
    groups = _uint(meta, f"{arch}.expert_group_count") or 0
    group_used = _uint(meta, f"{arch}.expert_group_used_count") or 0
    problems = []
    if n_expert > LLAMA_MAX_EXPERTS:
        problems.append(f"expert_count {n_expert} > {LLAMA_MAX_EXPERTS}")
    if used_max > n_expert:
        problems.append(f"expert_used_count {used_max} > expert_count {n_expert}")
    if n_expert > 0:
        if used_max == 0:
            problems.append("expert_used_count is 0 with experts")
        if groups >= n_expert:
            problems.append(f"expert_group_count {groups} >= expert_count {n_expert}")
        if groups > 1 and (n_expert % groups or not 0 < group_used < groups):
            problems.append("expert groups that do not divide the experts")
    elif groups:
        problems.append("expert_group_count without experts")
    if problems:
        out.add("error", "experts", f"{arch}: {'; '.join(problems)}: llama.cpp aborts")


def _check_tensors(
    meta: GGUFMetadata, arch: str, tensors: list[TensorInfo], out: _Findings
) -> None:
    """Required tensors and the shapes of the embedding and output (load_arch_tensors)."""
    by_name = {t.name: t for t in tensors}
    n_layer = _uint(meta, f"{arch}.block_count") or 0
    n_layer -= _uint(meta, f"{arch}.nextn_predict_layers") or 0
    n_expert = _uint(meta, f"{arch}.expert_count") or 0
    for alternatives in ARCH_TENSORS[arch](n_layer, n_expert):
        if not any(name in by_name for name in alternatives):
            out.add(
                "error",
                "missing-tensor",
                f"tensor {alternatives[-1]!r} is missing; llama.cpp's {arch} needs it",
            )
            return
    n_embd = _uint(meta, f"{arch}.embedding_length")
    n_vocab = _n_vocab(meta)
    if n_embd is None or n_vocab is None:
        return
    for name, shape in (
        ("token_embd.weight", (n_embd, n_vocab)),
        ("output.weight", (n_embd, n_vocab)),
        ("output_norm.weight", (n_embd,)),
    ):
        t = by_name.get(name)
        if t is not None and _padded(t.shape) != _padded(shape):
            out.add(
                "error",
                "tensor-shape",
                f"tensor {name!r} has shape {list(t.shape)}; llama.cpp expects "
                f"{list(shape)} (from the embedding length and the token count)",
            )


def _padded(shape: Sequence[int]) -> tuple[int, ...]:
    """A shape as ggml holds it: four dimensions, the missing ones 1."""
    return (*shape, *[1] * (4 - len(shape)))


def _n_vocab(meta: GGUFMetadata) -> int | None:
    """The vocabulary size llama.cpp gives the model: the token list's length."""
    tokens: Any = meta.get("tokenizer.ggml.tokens")
    if meta.kv_types.get("tokenizer.ggml.tokens") == "array[string]":
        return int(tokens.count)
    return None
