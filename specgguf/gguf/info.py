"""``specgguf info``: what a GGUF file holds, from its metadata alone (no weights load)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from specgguf.errors import GGUFFormatError, ModelLoadError
from specgguf.gguf.arch import MemoryKind, head_width, memory_kind, rolls_back
from specgguf.gguf.loadcheck import load_findings
from specgguf.gguf.metadata import FILE_TYPES, ArrayRef, Finding, GGUFMetadata, TensorInfo, shown
from specgguf.gguf.vocab import VocabInfo, read_vocab

#: Shards of a split model looked for after this many are found missing: none (a split
#: count can claim 65,535 shards).
MAX_MISSING_SHARDS = 8


@dataclasses.dataclass(frozen=True)
class WeightLayout:
    """A model's tensor bytes by where llama.cpp places them (``llama-model.cpp``,
    ``load_tensors``): the input layer (``token_embd``, always on the CPU), each repeating
    block ``blk.N`` (``blocks[N]``), the output layer (``output_norm`` and ``output``; where
    the output shares the embedding, llama.cpp loads ``token_embd`` a second time for the
    output layer: ``tied`` bytes of ``output`` are that copy), and tensors of none of these
    (``other``, kept with the input). Bytes as the tensor types store them (ggml block
    sizes), without the file's metadata and padding.
    """

    input: int
    blocks: tuple[int, ...]
    output: int
    other: int
    tied: int = 0

    @property
    def total(self) -> int:
        """Every tensor once (the output's copy of the embedding not counted)."""
        return self.input + sum(self.blocks) + self.output - self.tied + self.other


def tensor_bytes(t: TensorInfo) -> int:
    """Bytes of one tensor's data (ggml's block size and type size; gguf-py's table).

    Raises:
        KeyError: a ggml type id gguf-py does not know.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(t.ggml_type)]
    return t.n_elements // block * type_size


def weight_layout(tensors: list[TensorInfo], n_layer: int) -> WeightLayout | None:
    """The bytes per placement of ``tensors`` (see :class:`WeightLayout`); None when a
    tensor type is unknown (a newer ggml type) or ``n_layer`` is more than llama.cpp loads
    (``LLAMA_MAX_LAYERS``: the file's own block count sizes the table, so a corrupt one must
    not), so that estimates fall back to file sizes."""
    from specgguf.gguf.loadcheck import LLAMA_MAX_LAYERS

    if n_layer > LLAMA_MAX_LAYERS:
        return None
    blocks = [0] * n_layer
    inp = out = other = embd = 0
    has_output = False
    try:
        for t in tensors:
            n = tensor_bytes(t)
            name = t.name
            if name.startswith("blk."):
                idx = name.split(".", 2)[1]
                if idx.isdigit() and int(idx) < n_layer:
                    blocks[int(idx)] += n
                else:
                    other += n  # e.g. a multi-token-prediction block past n_layer
            elif name.startswith("token_embd."):
                inp += n
                embd += n if name == "token_embd.weight" else 0
            elif name.startswith("output"):
                out += n
                has_output = has_output or name == "output.weight"
            else:
                other += n
    except (KeyError, ValueError):
        return None
    tied = 0 if has_output else embd  # token_embd loaded again as the output (DUPLICATED)
    return WeightLayout(inp, tuple(blocks), out + tied, other, tied)


@dataclasses.dataclass(frozen=True)
class ModelInfo:
    """Facts about one GGUF model (sizes in bytes; counts of parameters and tokens; for a
    split model, ``shards`` and ``missing_shards`` stop at the
    :data:`MAX_MISSING_SHARDS`-th missing shard), and
    ``findings``: what llama.cpp would refuse (``error``) or warn about (``warning``) when
    loading it (:func:`specgguf.gguf.loadcheck.load_findings`), and metadata strings that
    are not UTF-8 (``warning``)."""

    path: Path
    architecture: str | None
    name: str | None
    size_label: str | None
    quantization: str | None
    n_params: int | None
    context_length: int | None
    block_count: int | None
    embedding_length: int | None
    head_count: int | None
    head_count_kv: int | None
    vocab: VocabInfo
    template: str | None = dataclasses.field(repr=False)
    n_tensors: int
    file_size: int
    layout: WeightLayout | None = dataclasses.field(repr=False)
    split_count: int
    shards: tuple[Path, ...]
    missing_shards: tuple[Path, ...]
    gguf_version: int
    findings: tuple[Finding, ...] = ()
    #: multi-token-prediction layers the file carries (``{arch}.nextn_predict_layers``)
    nextn_layers: int = 0
    #: layers that hold a recurrent state, and its bytes per sequence in those layers
    #: (F32, llama.cpp's ``n_embd_r() + n_embd_s()``; 0 for attention alone)
    recurrent_layers: int = 0
    recurrent_state_bytes: int = 0
    #: a draft head (an EAGLE-3 head, a DFlash draft): the target layers whose inputs it
    #: reads (``{arch}.target_layers``), the width of the target it was made for
    #: (``{arch}.target_hidden_size``; a DFlash draft's own), its reduced vocabulary (the
    #: ids of ``d2t``; 0: the target's)
    target_layers: tuple[int, ...] = ()
    target_width: int = 0
    draft_vocab: int = 0
    #: a DFlash draft's trained block (``dflash.block_size``), and the most tokens it
    #: drafts from it: one less, or the whole block for a DSpark draft whose block row 0
    #: predicts (``dflash.sample_from_anchor``, true where absent; common/speculative.cpp)
    draft_block: int = 0
    draft_block_max: int = 0
    #: a DFlash draft with a Markov head (``markov_w1``): DSpark, llama.cpp's
    #: ``draft-dspark``; and with a confidence head (``conf_proj``), which ``--draft-p-min``
    #: then reads
    markov_head: bool = False
    confidence_head: bool = False
    #: a DFlash2 draft (a DFlash file with a selector, ``selector_hidden``): the candidates
    #: per block row its selector scores (``dflash.selector_top_k``; 0: none)
    selector_top_k: int = 0

    @property
    def memory(self) -> MemoryKind:
        """What the architecture's memory holds (:func:`specgguf.gguf.arch.memory_kind`)."""
        return memory_kind(self.architecture)

    @property
    def attention_layers(self) -> int:
        """Layers with a KV cache: all of the trunk but the recurrent ones."""
        return max(0, (self.block_count or 0) - self.nextn_layers - self.recurrent_layers)

    @property
    def has_chat_template(self) -> bool:
        return self.template is not None

    @property
    def load_errors(self) -> list[Finding]:
        """The findings that make llama.cpp refuse the file (empty when it loads)."""
        return [f for f in self.findings if f.severity == "error"]

    def require_loadable(self) -> None:
        """Raise when llama.cpp would refuse the file.

        Raises:
            ModelLoadError: with the message of every error finding.
        """
        if self.load_errors:
            raise ModelLoadError(self.path, [f.message for f in self.load_errors])

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "architecture": self.architecture,
            "memory": self.memory,
            "rolls_back": rolls_back(self.architecture),
            "nextn_layers": self.nextn_layers,
            "target_layers": list(self.target_layers),
            "target_width": self.target_width,
            "draft_vocab": self.draft_vocab,
            "selector_top_k": self.selector_top_k,
            "draft_block": self.draft_block,
            "draft_block_max": self.draft_block_max,
            "markov_head": self.markov_head,
            "confidence_head": self.confidence_head,
            "recurrent_layers": self.recurrent_layers,
            "recurrent_state_bytes": self.recurrent_state_bytes,
            "name": self.name,
            "size_label": self.size_label,
            "quantization": self.quantization,
            "n_params": self.n_params,
            "context_length": self.context_length,
            "block_count": self.block_count,
            "embedding_length": self.embedding_length,
            "head_count": self.head_count,
            "head_count_kv": self.head_count_kv,
            "vocab": self.vocab.as_dict(),
            "has_chat_template": self.has_chat_template,
            "n_tensors": self.n_tensors,
            "file_size": self.file_size,
            "split_count": self.split_count,
            "shards": [str(p) for p in self.shards],
            "missing_shards": [str(p) for p in self.missing_shards],
            "gguf_version": self.gguf_version,
            "llama_cpp_loadable": not self.load_errors,
            "findings": [dataclasses.asdict(f) for f in self.findings],
        }


def _recurrent_layers(meta: Any, n_layer: int) -> int:
    """How many of the trunk's ``n_layer`` layers hold a recurrent state
    (llama-model.cpp's ``recurrent_layer_arr``): all for a recurrent architecture; for a
    hybrid one, those without KV heads (a per-layer ``head_count_kv`` array), or all but
    every ``full_attention_interval``-th (Qwen3-Next and Qwen3.5: default 4)."""
    kind = memory_kind(meta.architecture)
    if kind == "attention" or n_layer <= 0:
        return 0
    if kind == "recurrent":
        return n_layer
    kv = meta.arch_key("attention.head_count_kv")
    if isinstance(kv, list) and len(kv) >= n_layer:
        return sum(1 for x in kv[:n_layer] if not x)
    every = _int(meta.arch_key("full_attention_interval")) or 4
    return sum(1 for i in range(n_layer) if (i + 1) % every)


def _state_values(meta: Any) -> int:
    """Values of one layer's recurrent state (llama-hparams.cpp ``n_embd_r`` +
    ``n_embd_s``): RWKV's token shifts and wkv state, LFM2's short convolution, or a
    Mamba-style convolution and SSM state (Mamba, gated delta nets)."""
    n_embd = _int(meta.arch_key("embedding_length")) or 0
    head = _int(meta.arch_key("wkv.head_size"))
    if head:
        return (_int(meta.arch_key("token_shift_count")) or 2) * n_embd + n_embd * head
    l_cache = _int(meta.arch_key("shortconv.l_cache"))
    if l_cache:
        return n_embd * (l_cache - 1)
    d_conv = _int(meta.arch_key("ssm.conv_kernel")) or 0
    d_inner = _int(meta.arch_key("ssm.inner_size")) or 0
    d_state = _int(meta.arch_key("ssm.state_size")) or 0
    groups = _int(meta.arch_key("ssm.group_count")) or 0
    return max(0, d_conv - 1) * (d_inner + 2 * groups * d_state) + d_state * d_inner


def _str(v: Any) -> str | None:
    return v if isinstance(v, str) else None


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _numbers(meta: GGUFMetadata, ref: Any) -> tuple[int, ...]:
    """An integer array of the metadata (empty where the key is absent or no array of
    integers)."""
    if not isinstance(ref, ArrayRef):
        return ()
    try:
        return tuple(int(x) for x in meta.numbers(ref))
    except (TypeError, ValueError, GGUFFormatError):
        return ()


def read_model_info(path: Path | str) -> ModelInfo:
    """Read :class:`ModelInfo` from ``path`` (for a split model, from its first shard; the
    other shards add their tensor counts, sizes and parameters when present).

    Problems that would make llama.cpp refuse the file are not raised but listed in
    ``findings`` (:meth:`ModelInfo.require_loadable` raises for them).

    Raises:
        ModelNotFoundError: ``path`` does not exist.
        GGUFFormatError: ``path`` (or a present shard) is not a readable GGUF file.
    """
    with GGUFMetadata.open(path) as meta:
        if meta.split_count > 1 and meta.split_no != 0:
            raise GGUFFormatError(
                meta.path,
                f"shard {meta.split_no + 1} of {meta.split_count}; give the first shard "
                "(-00001-of-...) instead",
            )
        vocab = read_vocab(meta)
        shards: list[Path] = []
        present: list[Path] = []
        missing: list[Path] = []
        for shard in meta.shard_paths():
            shards.append(shard)
            (present if shard.is_file() else missing).append(shard)
            if len(missing) == MAX_MISSING_SHARDS:
                break
        n_tensors = meta.n_tensors
        tensors = list(meta.tensors())
        file_size = meta.file_size
        for shard in present:
            if shard == meta.path:
                continue
            with GGUFMetadata.open(shard) as sm:
                n_tensors += sm.n_tensors
                file_size += sm.file_size
                tensors += sm.tensors()
        n_params: int | None = sum(t.n_elements for t in tensors)
        block_count = _int(meta.arch_key("block_count"))
        layout = None if missing else weight_layout(tensors, block_count or 0)
        if missing:
            n_params = None
        ft = _int(meta.get("general.file_type"))
        nextn = _int(meta.arch_key("nextn_predict_layers")) or 0
        n_rec = _recurrent_layers(meta, (block_count or 0) - nextn)
        names = {t.name for t in tensors}
        dflash = meta.architecture == "dflash"
        block = (_int(meta.arch_key("block_size")) or 0) if dflash else 0
        markov = dflash and "markov_w1.weight" in names
        # (written as bools by llama.cpp's converters; "true"/"false" strings read too)
        anchor = _flag(meta.arch_key("sample_from_anchor"), default=True)
        said_conf = _flag(meta.arch_key("has_confidence_head"), default=True)
        findings = [
            Finding(
                "warning", "utf8", f"{shown(what)} is not valid UTF-8 (llama.cpp does not check)"
            )
            for what in meta.non_utf8_keys
        ]
        findings += load_findings(meta, vocab.findings)
        return ModelInfo(
            path=meta.path,
            architecture=meta.architecture,
            name=_str(meta.get("general.name")),
            size_label=_str(meta.get("general.size_label")),
            quantization=FILE_TYPES.get(ft, f"file_type {ft}") if ft is not None else None,
            n_params=n_params,
            context_length=_int(meta.arch_key("context_length")),
            block_count=block_count,
            embedding_length=_int(meta.arch_key("embedding_length")),
            head_count=_int(meta.arch_key("attention.head_count")),
            head_count_kv=_int(meta.arch_key("attention.head_count_kv")),
            vocab=vocab,
            template=_str(meta.get("tokenizer.chat_template")),
            n_tensors=n_tensors,
            file_size=file_size,
            layout=layout,
            split_count=meta.split_count,
            shards=tuple(shards),
            missing_shards=tuple(missing),
            gguf_version=meta.version,
            findings=tuple(findings),
            nextn_layers=nextn,
            target_layers=_numbers(meta, meta.arch_key("target_layers")),
            target_width=head_width(meta.architecture, lambda key: _int(meta.arch_key(key))),
            draft_vocab=next((t.shape[0] for t in tensors if t.name == "d2t"), 0),
            draft_block=block,
            draft_block_max=block if markov and anchor else max(block - 1, 0),
            markov_head=markov,
            confidence_head=markov and said_conf and "conf_proj.weight" in names,
            selector_top_k=(_int(meta.arch_key("selector_top_k")) or 0) if dflash else 0,
            recurrent_layers=n_rec,
            recurrent_state_bytes=n_rec * 4 * _state_values(meta),
        )


def _flag(v: Any, *, default: bool) -> bool:
    """A GGUF flag: a bool, or the strings "true"/"false" (llama.cpp reads both through
    ``llama_model_meta_val_str``); ``default`` where absent or anything else."""
    if isinstance(v, bool):
        return v
    return {"true": True, "false": False}.get(str(v), default) if v is not None else default


def tensor_names(path: Path) -> frozenset[str]:
    """The names of the tensors in ``path``'s GGUF file, and in the other shards of a
    split model that are present.

    Raises:
        ModelNotFoundError: ``path`` does not exist.
        GGUFFormatError: it (or a present shard) is not a readable GGUF file.
    """
    with GGUFMetadata.open(path) as meta:
        names = {t.name for t in meta.tensors()}
        shards = [p for p in meta.shard_paths() if p != meta.path and p.is_file()]
    for shard in shards:
        with GGUFMetadata.open(shard) as sm:
            names.update(t.name for t in sm.tensors())
    return frozenset(names)
