"""A small wrapper over llama-cpp-python's low-level API: models, contexts, batches.

``LlamaModel`` owns a ``llama_model *`` and its vocabulary; ``LlamaContext`` owns a
``llama_context *`` (and its KV cache) and one ``llama_batch``. Both free their native
memory deterministically in ``close()`` (or on leaving a ``with`` block), as
llama-cpp-python's ``_internals.py`` does with an ``ExitStack``. The high-level ``Llama``
class is not used: it keeps n_ctx x n_vocab float32 logits when ``logits_all`` is on, which
a verifier would need (151,936-token Qwen at n_ctx 2048: 1.2 GB). Here logits are requested
only at the batch positions that need them, and read as a zero-copy NumPy view.

The speculative loop only needs the :class:`specgguf.speculative.draft.TargetEvaluator` interface
(``eval``, ``rollback``, ``n_past``, ``n_ctx``, ``n_batch``, ``n_vocab``), which
``LlamaContext`` implements.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import functools
import logging
import math
import os
import re
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Literal, NoReturn, Self

import numpy as np
import numpy.typing as npt

from specgguf.errors import BackendError, ContextOverflowError, ModelNotFoundError, UsageError
from specgguf.gguf.arch import LAYER_INPUT_ARCHS
from specgguf.gguf.info import tensor_names
from specgguf.llama.hugepages import LoadAdvice
from specgguf.llama.runtime import llama, local_gpu_offload, native_fn, repack_policy

log = logging.getLogger("specgguf")
_warned_repack = False


@functools.cache
def _ext() -> Any:
    """llama.cpp's staging functions (src/llama-ext.h) that llama-cpp-python 0.3.36 does
    not bind: a layer's input rows of every decoded token, and a draft head's target
    layers, by their C++ symbols (llama-ext.h is C++), as ``llama_cpp_ext`` binds its own."""
    from llama_cpp import llama_cpp

    lib, ctx_p, model_p = (
        llama_cpp._lib,
        llama_cpp.llama_context_p_ctypes,
        llama_cpp.llama_model_p_ctypes,
    )
    out = {}
    for name, symbol, args, res in (
        ("set_layer_inp", "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
         [ctx_p, ctypes.c_uint32, ctypes.c_bool], None),
        ("get_layer_inp", "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
         [ctx_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)),
        ("target_layers", "_Z28llama_model_target_layer_idsPK11llama_model",
         [model_p], ctypes.POINTER(ctypes.c_int32)),
        ("target_layers_n", "_Z30llama_model_target_layer_ids_nPK11llama_model",
         [model_p], ctypes.c_uint32),
    ):  # fmt: skip
        try:
            fn = getattr(lib, symbol)
        except AttributeError:
            raise BackendError(
                f"this llama.cpp build has no {symbol} (llama-ext.h): "
                "EAGLE-3 heads need llama-cpp-python 0.3.36"
            ) from None
        fn.argtypes, fn.restype = args, res
        out[name] = fn
    return out


#: K cache data types by llama.cpp's names (``-ctk``) -> ``ggml_type`` values. With a q8_0 K
#: cache llama.cpp's CPU FlashAttention computes every row, lone or in a batch, the same way
#: (its split-KV path for a lone row and tiled path for 64+ rows take f16 and f32 caches
#: only: ggml-cpu/ops.cpp, ``ggml_compute_forward_flash_attn_ext_f16``), which is what
#: deterministic mode uses (:mod:`specgguf.llama.invariance`).
KV_CACHE_TYPES = {"f16": 1, "q8_0": 8}
#: What a model's memory holds (:attr:`LlamaModel.memory`).
MemoryKind = Literal["attention", "recurrent", "hybrid"]

#: ``llama_token_attr`` flags of the tokens whose texts llama.cpp parses as special:
#: LLAMA_TOKEN_ATTR_UNKNOWN, LLAMA_TOKEN_ATTR_CONTROL, LLAMA_TOKEN_ATTR_USER_DEFINED
_SPECIAL_ATTRS = 1 << 0 | 1 << 3 | 1 << 4
#: Of those, the ones parsed only with ``parse_special``: unknown and control.
_CONTROL_ATTRS = 1 << 0 | 1 << 3


def default_threads() -> int:
    """Threads for generation: the physical core count (llama.cpp's common default)."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False)
    except Exception:  # pragma: no cover - psutil is a dependency
        n = None
    return max(1, n or os.cpu_count() or 1)


@dataclasses.dataclass(frozen=True, eq=False)
class MediaSpan:
    """A medium's embeddings at rows ``start`` to ``start + len(embd)`` of a sequence:
    ``embd`` float32[n, n_embd]; ``key`` its content's hash (a cached prompt is reused
    past a medium only where the same content is there); ``non_causal``: its rows attend
    to each other both ways (decoded in one micro-batch).

    ``pos``: for a target with M-RoPE (Qwen2-VL and later), each row's four position
    components, section by section (int32[4, n]: time, height, width, unused, as
    libmtmd's ``mtmd_helper_decode_image_chunk`` gives them), and ``n_pos`` the positions
    the medium takes: an image's rows share positions, so that a row ``i`` after the
    media of a sequence is at position ``i`` less their :attr:`shift` summed. None and 0:
    one position a row.

    ``draft``: the same medium's rows for the draft model, at the same rows of its
    sequence (its own positions), or None: the draft reads the placeholder tokens."""

    start: int
    embd: npt.NDArray[np.float32]
    key: bytes
    non_causal: bool = False
    pos: npt.NDArray[np.int32] | None = None
    n_pos: int = 0
    draft: MediaSpan | None = None

    @property
    def end(self) -> int:
        return self.start + len(self.embd)

    @property
    def shift(self) -> int:
        """How many fewer positions than rows the medium takes."""
        return len(self.embd) - self.n_pos if self.n_pos else 0

    def same(self, other: MediaSpan) -> bool:
        """The same medium at the same positions."""
        return (self.start, self.end, self.key) == (other.start, other.end, other.key)


#: llama.cpp's M-RoPE rope types (ggml.h: GGML_ROPE_TYPE_MROPE, GGML_ROPE_TYPE_IMROPE)
_MROPE_TYPES = (8, 40)


def media_prefix(
    n: int, held: Iterable[MediaSpan], wanted: Iterable[MediaSpan], *, before: bool = False
) -> int:
    """``n`` leading rows that a cache holding the media ``held`` shares with a prompt of
    the media ``wanted`` (whose tokens share ``n`` rows), cut before the first medium they
    do not share (other content, or only one of them has one there: the placeholder
    tokens are the same whatever the image), and never inside a medium; ``before``: one
    row before such a medium (a head's first row there reads the hidden state of the row
    before, which must be computed again, as a head's ``reuse_limit`` has it for text)."""
    mine = {m.start: m for m in held}
    plan = {m.start: m for m in wanted}
    for m in sorted([*mine.values(), *plan.values()], key=lambda m: m.start, reverse=True):
        if m.start < n:
            have, want = mine.get(m.start), plan.get(m.start)
            if have is None or want is None or not have.same(want) or n < m.end:
                n = max(0, m.start - 1) if before else m.start
    return n


def _text_runs(start: int, end: int, media: Sequence[MediaSpan]) -> Iterator[tuple[int, int]]:
    """Positions ``start .. end - 1`` in order, as runs: ``(at, stop)`` of text, and
    ``(-1 - i, stop)`` for ``media[i]`` (in position order, each inside, ending at
    ``stop``)."""
    at = start
    for i, m in enumerate(media):
        if m.start > at:
            yield at, m.start
        yield -1 - i, m.end
        at = m.end
    if end > at:
        yield at, end


def _spans(media: Sequence[object]) -> list[MediaSpan]:
    """``media`` as :class:`MediaSpan`\\ s in position order.

    Raises:
        TypeError: something else than a MediaSpan.
    """
    if not media:
        return []
    if not all(isinstance(m, MediaSpan) for m in media):
        raise TypeError("a context reads media given as MediaSpan objects")
    return sorted(media, key=lambda m: m.start)  # type: ignore[arg-type, attr-defined]


class _Native:
    """Owns native memory: freed by :meth:`close` (idempotent), on leaving a ``with``
    block, or at garbage collection as a last resort. Subclasses free in ``_free``."""

    def _free(self) -> None:
        raise NotImplementedError

    def _is_open(self) -> bool:
        raise NotImplementedError

    def close(self) -> None:
        """Free the native memory; idempotent."""
        self._free()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            if self._is_open():
                self.close()
        except AttributeError:  # __init__ failed before the handles were set
            pass


def _placement(devices: Sequence[int], n_gpu_layers: int, tensor_split: Sequence[float]) -> str:
    """``RPC0=10.0.0.2:50052,CUDA0=NVIDIA ...;ngl=-1;ts=3,1``: devices by name and
    description (an RPC device's is its server), the layer count and the split."""
    name = native_fn("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)
    desc = native_fn("ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)
    devs = ",".join(f"{(name(d) or b'').decode()}={(desc(d) or b'').decode()}" for d in devices)
    split = ",".join(f"{x:g}" for x in tensor_split)
    return f"{devs};ngl={n_gpu_layers};ts={split}"


class LlamaModel(_Native):
    """A GGUF model loaded by llama.cpp (weights and vocabulary).

    Args:
        path: the .gguf file (the first shard of a split model: llama.cpp finds the rest).
        n_gpu_layers: layers to offload; -1 offloads all, 0 none (default: all when the
            build can offload, which llama.cpp ignores on CPU-only builds).
        use_extra_bufts: weight repacking; None asks :func:`specgguf.llama.runtime.repack_policy`.
        vocab_only: load only the vocabulary (no weights).
        devices: the devices the layers may go to, in order (``llama_model_params.devices``):
            a ggml device name (``CUDA0``) or a ``ggml_backend_dev_t`` address (an RPC
            server's device, see :mod:`specgguf.llama.rpc`); () none: the CPU only; None:
            llama.cpp's default, this machine's GPUs (common/arg.cpp ``parse_device_list``).
        tensor_split: the proportion of the offloaded layers per device, in that order
            (``llama_model_params.tensor_split``); empty: by free memory.
        progress: called with the share of the weights loaded (0.0 to 1.0) as llama.cpp
            loads them (``llama_model_params.progress_callback``); an exception raised in
            it (Ctrl-C) aborts the load and is raised again here.
        huge_pages: advise transparent huge pages for the weights held in this process's
            memory when ``SPECGGUF_HUGEPAGES`` does not say (see
            :mod:`specgguf.llama.hugepages`); ``huge_pages_advised`` is then the bytes.
        load_mtp: also load the multi-token-prediction layers the file carries
            (``llama_model_params.load_mtp``), for :class:`MtpHead`.

    Raises:
        ModelNotFoundError: ``path`` does not exist.
        UsageError: a device name this build does not have (or a CPU device).
        BackendError: llama.cpp could not load the file.
    """

    def __init__(
        self,
        path: Path | str,
        *,
        n_gpu_layers: int = -1,
        use_extra_bufts: bool | None = None,
        vocab_only: bool = False,
        devices: Sequence[str | int] | None = None,
        tensor_split: Sequence[float] = (),
        progress: Callable[[float], None] | None = None,
        huge_pages: bool = False,
        load_mtp: bool = False,
    ) -> None:
        self._lc = lc = llama()
        self.path = Path(path)
        self._model: Any = None  # llama_model * (ctypes)
        if not self.path.is_file():
            raise ModelNotFoundError(f"model file not found: {self.path}", path=self.path)
        if use_extra_bufts is None and not vocab_only:
            policy = repack_policy()
            use_extra_bufts = policy.use_extra_bufts
            global _warned_repack
            if policy.warning and not _warned_repack:
                _warned_repack = True
                log.warning(policy.warning)
        params = lc.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        params.vocab_only = vocab_only
        params.load_mtp = load_mtp
        params.use_extra_bufts = True if use_extra_bufts is None else use_extra_bufts
        handles = _device_handles(lc, devices) if devices is not None else None
        #: whether layers may go to a device (a local GPU, an RPC server)
        self.offloads = bool(handles) if handles is not None else local_gpu_offload()
        #: where the layers go when the devices are given ("" for llama.cpp's default),
        #: for cache keys of measured timings and invariances
        self.placement = "" if handles is None else _placement(handles, n_gpu_layers, tensor_split)
        if params.use_extra_bufts and not vocab_only and not self.offloads:
            # Repacked weights are copies: read the file instead of mapping it, or its pages
            # stay resident next to the copies (1.9 GB instead of 1.3 GB for a 1.1 GB file).
            params.load_mode = 0  # LLAMA_LOAD_MODE_NONE
        self.use_extra_bufts = bool(params.use_extra_bufts)
        # The arrays and the callback must outlive the load call: llama.cpp reads them
        # during it.
        device_array = None
        if handles is not None:
            device_array = (ctypes.c_void_p * (len(handles) + 1))(*handles, None)
            params.devices = ctypes.cast(device_array, ctypes.c_void_p)
        split_array = None
        if tensor_split:
            n_max = int(lc.llama_max_devices())
            split_array = (ctypes.c_float * n_max)(*list(tensor_split)[:n_max])
            params.tensor_split = ctypes.cast(split_array, ctypes.POINTER(ctypes.c_float))
        raised: list[BaseException] = []
        # Weights in this process's memory (repacked, or read: not offloaded) get huge pages.
        in_memory = params.use_extra_bufts and not vocab_only and not self.offloads
        advice = LoadAdvice(huge_pages) if in_memory else None
        if advice is not None and advice.active:
            progress = _advised(advice, progress)
        callback = _progress_callback(lc, progress, raised) if progress is not None else None
        if callback is not None:
            params.progress_callback = callback
        model = lc.llama_model_load_from_file(str(self.path).encode(), params)
        #: bytes of weights advised to transparent huge pages (:mod:`specgguf.llama.hugepages`)
        self.huge_pages_advised = advice.advised if advice is not None else 0
        del device_array, split_array
        if raised:
            if model:
                lc.llama_model_free(model)
            raise raised[0]
        if not model:
            raise BackendError(f"llama.cpp could not load {self.path}")
        self._model = model
        self._vocab = lc.llama_model_get_vocab(model)
        self.n_vocab: int = lc.llama_vocab_n_tokens(self._vocab)
        self.n_ctx_train: int = lc.llama_model_n_ctx_train(model)
        self.n_layer: int = lc.llama_model_n_layer(model)
        self.n_embd: int = lc.llama_model_n_embd(model)
        #: the width of the rows it reads in place of tokens (an image's embeddings):
        #: n_embd, more with Qwen3-VL's "deepstack" rows beside them (llama_model_n_embd_inp)
        self.n_embd_inp: int = lc.llama_model_n_embd_inp(model)
        #: whether its positions have M-RoPE's four sections (Qwen2-VL and later)
        self.mrope: bool = lc.llama_model_rope_type(model) in _MROPE_TYPES
        buf = ctypes.create_string_buffer(64)
        n = lc.llama_model_meta_val_str(model, b"general.architecture", buf, len(buf))
        #: ``general.architecture`` ("" where the file gives none)
        self.architecture: str = buf.value.decode(errors="replace") if n > 0 else ""
        #: what the model's memory holds: "attention" (a KV cache, cut anywhere),
        #: "recurrent" (a state per sequence) or "hybrid" (both)
        self.memory: MemoryKind = (
            "hybrid" if lc.llama_model_is_hybrid(model)
            else "recurrent" if lc.llama_model_is_recurrent(model) else "attention"
        )  # fmt: skip
        #: the attention window of the sliding-window layers (0: none), whose KV cache
        #: forgets positions older than the window
        self.n_swa: int = int(lc.llama_model_n_swa(model))
        #: multi-token-prediction layers loaded (0 unless ``load_mtp`` and the file has them)
        self.n_layer_nextn: int = int(lc.llama_model_n_layer_nextn(model)) if load_mtp else 0
        self.add_bos: bool = bool(lc.llama_vocab_get_add_bos(self._vocab))
        self.bos: int = lc.llama_vocab_bos(self._vocab)
        self.eos: int = lc.llama_vocab_eos(self._vocab)
        self.eog_ids: frozenset[int] = frozenset(
            i for i in range(self.n_vocab) if lc.llama_vocab_is_eog(self._vocab, i)
        )
        self._pieces: dict[int, bytes] = {}
        self._contexts: weakref.WeakSet[LlamaContext] = weakref.WeakSet()

    # -- vocabulary -------------------------------------------------------------------

    def tokenize(
        self, text: str | bytes, *, add_special: bool = True, parse_special: bool = True
    ) -> list[int]:
        """Token ids of ``text`` with this model's rules (BOS added when the model's
        ``add_bos`` says so and ``add_special``; special-token texts parsed)."""
        data = text.encode("utf-8") if isinstance(text, str) else text
        n_max = len(data) + 8
        buf = (self._lc.llama_token * n_max)()
        n = self._lc.llama_tokenize(
            self._live_vocab(), data, len(data), buf, n_max, add_special, parse_special
        )
        if n < 0:
            n_max = -n
            buf = (self._lc.llama_token * n_max)()
            n = self._lc.llama_tokenize(
                self._live_vocab(), data, len(data), buf, n_max, add_special, parse_special
            )
        if n < 0:  # pragma: no cover - llama.cpp told us the size just before
            raise BackendError(f"tokenization failed ({n})")
        return list(buf[:n])

    def token_to_piece(self, token: int) -> bytes:
        """The bytes of one token as it appears in generated text (special tokens
        rendered); possibly part of a UTF-8 character. Cached per id."""
        piece = self._pieces.get(token)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = self._lc.llama_token_to_piece(self._live_vocab(), token, buf, 64, 0, True)
            if n < 0:
                buf = ctypes.create_string_buffer(-n)
                n = self._lc.llama_token_to_piece(self._live_vocab(), token, buf, -n, 0, True)
            piece = buf.raw[:n]
            self._pieces[token] = piece
        return piece

    def detokenize(self, tokens: Sequence[int]) -> bytes:
        """The concatenated pieces of ``tokens`` (no special-token removal)."""
        return b"".join(self.token_to_piece(t) for t in tokens)

    def chat_template(self) -> str | None:
        """The GGUF's ``tokenizer.chat_template``, or None."""
        raw = self._lc.llama_model_chat_template(self.handle, None)
        return raw.decode("utf-8") if raw else None

    def token_text(self, token: int) -> str:
        """The vocabulary's text of ``token`` (``tokenizer.ggml.tokens[token]``)."""
        raw = self._lc.llama_vocab_get_text(self._live_vocab(), token)
        return raw.decode("utf-8", errors="replace") if raw else ""

    @functools.cached_property
    def _special_attrs(self) -> dict[str, int]:
        """The text of every token llama.cpp parses as special (control, user-defined and
        unknown tokens: ``cache_special_tokens`` in src/llama-vocab.cpp) and its
        ``llama_token_attr`` flags. Read from the vocabulary once (about 0.1 s for 151,936
        tokens)."""
        vocab = self._live_vocab()
        attr = native_fn("llama_vocab_get_attr", ctypes.c_int, ctypes.c_void_p, ctypes.c_int32)
        found: dict[str, int] = {}
        for t in range(self.n_vocab):
            a = attr(vocab, t)
            if a & _SPECIAL_ATTRS:
                text = self.token_text(t)
                if text:
                    found[text] = found.get(text, 0) | a
        return found

    @functools.cached_property
    def control_ids(self) -> frozenset[int]:
        """The ids of the control tokens (``LLAMA_TOKEN_ATTR_CONTROL``: ``<|im_end|>``,
        ``<s>``; not user-defined ones), read from the vocabulary once."""
        vocab = self._live_vocab()
        attr = native_fn("llama_vocab_get_attr", ctypes.c_int, ctypes.c_void_p, ctypes.c_int32)
        return frozenset(t for t in range(self.n_vocab) if attr(vocab, t) & 1 << 3)

    @property
    def special_attrs(self) -> dict[str, int]:
        """The text of every token llama.cpp parses as special and its
        ``llama_token_attr`` flags (see :attr:`_special_attrs`)."""
        return self._special_attrs

    @functools.cached_property
    def special_pattern(self) -> re.Pattern[str] | None:
        """A regular expression that finds the special-token texts, longest first (None:
        the vocabulary has none)."""
        texts = self._special_texts
        return re.compile("|".join(re.escape(t) for t in texts)) if texts else None

    @functools.cached_property
    def _special_texts(self) -> tuple[str, ...]:
        """The texts of :attr:`_special_attrs`, longest first as llama.cpp splits them."""
        return tuple(sorted(self._special_attrs, key=len, reverse=True))

    @functools.cached_property
    def control_texts(self) -> tuple[str, ...]:
        """The texts llama.cpp parses as special tokens only when asked to
        (``parse_special``: control and unknown tokens; user-defined ones are split out
        always), longest first."""
        return tuple(t for t in self._special_texts if self._special_attrs[t] & _CONTROL_ATTRS)

    def min_tokens(self, text: str, *, at_least: int = 0) -> int:
        """A lower bound on ``len(tokenize(text))`` (special-token texts parsed) that costs
        a few string splits, not a tokenization: llama.cpp first splits the special-token
        texts out of the text, longest first, each one token (``tokenizer_st_partition``
        in src/llama-vocab.cpp, done here the same way), and then tokenizes each piece of
        text between them into one token at least. That split is quadratic in llama.cpp
        (120,000 ``<|im_end|>`` take 25 s on 2 cores), so a prompt can be refused by this
        bound before it is tokenized.

        Returns 0 without looking when ``text`` has fewer than ``at_least`` characters (this
        bound, at most one token per character, could not reach ``at_least``)."""
        if len(text) < at_least:
            return 0
        n, pieces = 0, [text] if text else []
        for special in self._special_texts:
            if special not in text:  # (a piece holds nothing its text does not)
                continue
            split: list[str] = []
            for piece in pieces:
                parts = piece.split(special)
                n += len(parts) - 1
                split.extend(p for p in parts if p)
            pieces = split
        # A piece of whitespace alone may be taken into a special token (lstrip/rstrip).
        return n + sum(1 for p in pieces if not p.isspace())

    # -- contexts and lifetime ----------------------------------------------------------

    def new_context(
        self,
        *,
        n_ctx: int = 2048,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_outputs_max: int = 64,
        n_ubatch: int | None = None,
        reserve: int = 0,
        tree_branches: int = 0,
        type_k: str = "f16",
        n_rs_seq: int = 0,
        scratch: bool = False,
        hidden: bool = False,
        n_parallel: int = 1,
        kv_unified: bool = False,
        n_checkpoints: int = 0,
        replay: bool = False,
        layer_inputs: Sequence[int] = (),
    ) -> LlamaContext:
        """A new context (KV cache of ``n_ctx`` positions, and ``reserve`` more that only
        deterministic mode's throw-away rows use) on this model; ``tree_branches``,
        ``type_k``, ``n_rs_seq``, ``scratch``, ``hidden``, ``n_parallel``, ``kv_unified``,
        ``n_checkpoints``, ``replay`` and ``layer_inputs``: see :class:`LlamaContext`."""
        return LlamaContext(
            self, n_ctx=n_ctx, n_batch=n_batch, n_threads=n_threads,
            n_threads_batch=n_threads_batch, n_outputs_max=n_outputs_max, n_ubatch=n_ubatch,
            reserve=reserve, tree_branches=tree_branches, type_k=type_k, n_rs_seq=n_rs_seq,
            scratch=scratch, hidden=hidden, n_parallel=n_parallel, kv_unified=kv_unified,
            n_checkpoints=n_checkpoints, replay=replay, layer_inputs=layer_inputs,
        )  # fmt: skip

    def _live_vocab(self) -> Any:
        if self._model is None:
            raise BackendError("the model was closed")
        return self._vocab

    @property
    def handle(self) -> Any:
        if self._model is None:
            raise BackendError("the model was closed")
        return self._model

    def _is_open(self) -> bool:
        return self._model is not None

    def _free(self) -> None:
        """Free the model (and any context still open on it first)."""
        for ctx in list(self._contexts):
            ctx.close()
        if self._model is not None:
            self._lc.llama_model_free(self._model)
            self._model = None


def _device_handles(lc: Any, names: Sequence[str | int]) -> list[int]:
    """The ``ggml_backend_dev_t`` addresses of the devices ``names`` names, as llama.cpp's
    ``parse_device_list`` finds them (CPU devices are refused there too); an int is a
    device's address already (an RPC server's device), taken as it is.

    Raises:
        UsageError: a name this build has no (non-CPU) device for.
    """
    lib = lc._lib
    lib.ggml_backend_dev_by_name.restype = ctypes.c_void_p
    lib.ggml_backend_dev_by_name.argtypes = [ctypes.c_char_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    handles: list[int] = []
    for name in names:
        if isinstance(name, int):
            handles.append(name)
            continue
        dev = lib.ggml_backend_dev_by_name(name.encode())
        if not dev or lib.ggml_backend_dev_type(dev) == 0:  # GGML_BACKEND_DEVICE_TYPE_CPU
            from specgguf.llama.runtime import build_info

            known = [d.name for d in build_info().devices if d.kind != "cpu"]
            raise UsageError(
                f"no device {name!r} to offload to in this llama.cpp build "
                f"({'devices: ' + ', '.join(known) if known else 'it has none besides the CPU'})"
            )
        handles.append(int(dev))
    return handles


def _advised(
    advice: LoadAdvice, progress: Callable[[float], None] | None
) -> Callable[[float], None]:
    """``progress`` that first lets ``advice`` see the load's buffers."""

    def hook(value: float) -> None:
        advice.on_progress(value)
        if progress is not None:
            progress(value)

    return hook


def _progress_callback(
    lc: Any, progress: Callable[[float], None], raised: list[BaseException]
) -> Any:
    """``progress`` as a ``llama_progress_callback``: an exception in it (Ctrl-C during a
    long load) is kept in ``raised`` and stops the load (returning false)."""

    @lc.llama_progress_callback  # type: ignore[untyped-decorator]
    def callback(value: float, user_data: ctypes.c_void_p) -> bool:
        if raised:
            return False
        try:
            progress(float(value))
        except BaseException as e:  # ctypes cannot pass it through: raised after the load
            raised.append(e)
            return False
        return True

    return callback


#: ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``: the parts of a sequence's memory that cannot be
#: cut (a recurrent state, a sliding window's cells) without the rest
_STATE_PARTIAL = 1

#: A recurrent state's checkpoints are taken every this many positions of a long prompt
#: (rounded down to whole micro-batches), and after each prompt: a prompt that shares a
#: long document with an earlier one but not its end reads again at most this much of it.
#: A decode of at most this many rows fills llama.cpp's batch through ctypes arrays (a
#: step's rows: about 1.5 us against numpy's 2.5 at 8 rows), one of more through numpy's
#: slicing (a prompt's chunk: 4 us against 8 at 64 rows; 2-core EPYC).
_FEW_ROWS = 16

CHECKPOINT_STEP = 1024
#: ... and this many positions before the end of each prompt (llama-server's 4).
CHECKPOINT_TAIL = 4


@dataclasses.dataclass(frozen=True)
class Checkpoint:
    """A recurrent state after the first ``n`` positions of its sequence: llama.cpp's
    partial sequence state (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``), ``data`` bytes."""

    n: int
    data: bytes


@dataclasses.dataclass(frozen=True, eq=False)
class SequenceState:
    """What a sequence held, copied out of llama.cpp (:meth:`LlamaContext.save_state`):
    its ``tokens`` (int32[n]), the state ``data`` (``llama_state_seq_get_data``; b"" for
    none), its checkpoints, and how many leading positions were computed exactly as a
    fresh read (``exact``, see :meth:`LlamaContext.reuse`), and the media its positions
    hold (``media``: their tokens are placeholders; kept in memory only)."""

    tokens: npt.NDArray[np.int32]
    data: bytes
    checkpoints: tuple[Checkpoint, ...] = ()
    exact: int = 0
    media: tuple[MediaSpan, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes it holds: the state, its checkpoints, its tokens and its media's rows
        (the draft model's too, where they are its own)."""
        rows = sum(m.embd.nbytes + (m.draft.embd.nbytes if m.draft is not None
                                    and m.draft.embd is not m.embd else 0)
                   for m in self.media)  # fmt: skip
        return (len(self.data) + sum(len(c.data) for c in self.checkpoints)
                + self.tokens.nbytes + rows)  # fmt: skip


class LlamaContext(_Native):
    """A llama.cpp context: a KV cache of ``n_ctx`` positions for one sequence, a batch
    of up to ``n_batch`` tokens, and timing of every evaluation. llama.cpp may allocate
    more positions than asked (``n_ctx_allocated``); the context keeps to ``n_ctx``, so
    that a generation ends where the user's context size says.

    ``n_past`` is the number of positions held in the KV cache; ``eval`` appends,
    ``rollback`` truncates. At most ``n_outputs_max`` positions of one batch can return
    logits (a verification needs K + 1): llama.cpp sizes its logits and compute buffers by
    it, which for a 151,936-token vocabulary is 0.6 MB per output instead of n_batch rows.
    ``n_ubatch`` (tokens per llama.cpp graph) sizes the compute buffer; by default 512 on
    builds that offload to a GPU, where large batches speed up prompt processing, and 128
    on CPU-only builds, where prompt speed is the same (measured on Qwen2.5 1.5B: 69-82
    tokens/s at 512, 72-74 at 128) and a prefill touches 30 MB less on that model.

    ``tree_branches`` (2 or more) lets :meth:`eval_tree` verify token trees of up to that
    many leaves: the context then has ``tree_branches + 1`` llama.cpp sequences over one
    unified KV cache (``kv_unified``: without it llama.cpp splits the cache per sequence,
    and refuses a batch whose tokens belong to several). Sequence 0 is the committed text,
    the only one outside :meth:`eval_tree`. With 0 or 1 the context has one sequence, as
    without trees.

    ``type_k`` is the K cache's data type by llama.cpp's name (``-ctk``; "f16" or "q8_0",
    :data:`KV_CACHE_TYPES`); the V cache is f16. llama.cpp refuses q8_0 for attention heads
    of fewer than 32 values (a BackendError here).

    Recurrent and hybrid models (:attr:`LlamaModel.memory`) hold a state per sequence,
    which a cut of the cache cannot simply shorten. ``n_rs_seq`` asks llama.cpp to keep
    that many per-token snapshots of it (``llama_context_params.n_rs_seq``,
    src/llama-memory-recurrent.cpp ``seq_rm``): right after a decode of m rows, up to
    ``min(n_rs_seq, m - 1)`` of them can then be dropped (:attr:`rollback_room`; once,
    until the next decode). llama.cpp keeps snapshots only for some architectures
    (``llm_arch_supports_rs_rollback``: :attr:`n_rs_seq` is then what it granted) and needs
    a micro-batch of at least ``n_rs_seq + 2`` tokens, which is ensured here. A deeper
    :meth:`rollback` clears the sequence and decodes the tokens kept again: correct, and
    as slow as reading them.

    Where llama.cpp keeps no snapshots (``n_rs_seq`` 0: mamba, rwkv, jamba, qwen3next,
    granitehybrid, falcon-h1 in this build), ``replay`` drops a verification's rejected
    rows by checkpoint and replay, as llama-server does (#19493): an evaluation of two or
    more rows with every row's logits (a verification) first copies the recurrent state
    (llama.cpp's ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``), and a rollback into those rows
    loads the copy back, cuts the KV cache there and keeps the rows kept as tokens to
    decode first in the next evaluation's batch (so that they cost what rows add to a
    batch, not a decode of their own; at once where the hidden states are kept, which the
    MTP layers read first, and after a second rejection in a row), whose verification
    then needs no copy of its own
    (:meth:`replay_seconds` measures the copies). :attr:`rollback_room` then covers the
    verification's rows, and :attr:`rollback_max` is the batch.

    ``scratch`` gives the context a second sequence for :meth:`scratch` (a draft model's
    own draft tokens, evaluated and then dropped whole, which needs no rollback).
    ``hidden`` keeps the hidden state after every position decoded
    (``llama_set_embeddings_nextn``) for :meth:`hidden_rows`, which an :class:`MtpHead`
    reads: float32 rows of ``n_embd_out`` values, kept until :meth:`forget_hidden` (at
    most one per cached position: 20 KB a position for a 5120-wide model).
    ``layer_inputs`` keeps instead the inputs of those layers side by side (rows of
    ``n_hidden`` values; llama.cpp's ``llama_set_embeddings_layer_inp``), which an
    :class:`Eagle3Head` reads: only for architectures whose llama.cpp graph keeps them
    (:data:`specgguf.gguf.arch.LAYER_INPUT_ARCHS`; a BackendError otherwise, where llama.cpp
    would abort).

    ``n_parallel`` (2 or more) holds that many independent sequences (llama.cpp's
    ``n_seq_max``), each of ``n_ctx`` positions in a KV stream of its own (``kv_unified``
    off): a sequence's attention spans only its own cells, so that what it computes does
    not depend on the other sequences' cells (in a unified cache they interleave with its
    own, which changes the order of its sums: measured on the tiny models, a 400-token
    greedy text then differed from the same request alone). The price: llama.cpp splits a
    batch whose sequences bring different numbers of rows into micro-batches of equal rows
    per sequence (``split_equal``), each reading the weights again; measured on a 2-core
    AMD EPYC with the 1.5B/0.5B pair, 4 sequences in auto mode, 2-3% of aggregate
    tokens/s; more where a batch's rows cost little (a GPU), which auto mode weighs
    (:func:`specgguf.speculative.costmodel.micro_batches`). ``kv_unified`` shares one
    cache of ``n_parallel * n_ctx`` cells instead, as llama-server's slots do. This
    context is sequence 0; :meth:`sequence` gives the others, each with its own ``n_past``,
    rollback and timing, and :meth:`decode_many` decodes several sequences' tokens in one
    ``llama_decode``. Such a context has no trees or scratch sequence; with ``hidden``,
    each sequence keeps the hidden states of its own positions.

    What a sequence holds outlives a generation: :meth:`reuse` keeps the longest prefix a
    new prompt shares with it, :meth:`prompt` reads the rest, and :meth:`save_state` /
    :meth:`load_state` copy it out of llama.cpp and back (a host-memory or file prompt
    cache). A recurrent state cannot be cut at any position: with ``n_checkpoints``, the
    sequence keeps up to that many copies of it (:class:`Checkpoint`, llama.cpp's
    ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` state: the recurrent part alone, as
    llama-server's ``--ctx-checkpoints``), taken after each prompt and every
    :data:`CHECKPOINT_STEP` positions of a long one, and :meth:`reuse` restores the deepest
    at or below the shared prefix.

    Raises:
        BackendError: llama.cpp could not create the context.
        ValueError: ``n_parallel`` with trees or a scratch sequence.
    """

    def __init__(
        self,
        model: LlamaModel,
        *,
        n_ctx: int = 2048,
        n_batch: int = 512,
        n_threads: int | None = None,
        n_threads_batch: int | None = None,
        n_outputs_max: int = 64,
        n_ubatch: int | None = None,
        reserve: int = 0,
        tree_branches: int = 0,
        type_k: str = "f16",
        n_rs_seq: int = 0,
        scratch: bool = False,
        hidden: bool = False,
        n_parallel: int = 1,
        kv_unified: bool = False,
        n_checkpoints: int = 0,
        replay: bool = False,
        layer_inputs: Sequence[int] = (),
    ) -> None:
        if n_parallel > 1 and (tree_branches >= 2 or scratch):
            raise ValueError("parallel sequences have no trees or scratch sequence")
        self._lc = lc = model._lc
        self.model = model
        self._ctx: Any = None  # llama_context * (ctypes)
        self._batch: Any = None  # a llama_batch struct (ctypes)
        threads = n_threads or default_threads()
        params = lc.llama_context_default_params()
        #: independent sequences (this context is sequence 0, see :meth:`sequence`)
        self.n_parallel = max(1, n_parallel)
        params.n_ctx = (n_ctx + reserve) * self.n_parallel if n_ctx > 0 else 0
        params.n_batch = n_batch
        if n_ubatch is None:
            n_ubatch = 512 if model.offloads else 128
        params.n_ubatch = min(n_batch, n_ubatch)
        params.n_outputs_max = min(n_outputs_max, n_batch)
        #: the most leaves :meth:`eval_tree` accepts (0: no trees, one sequence)
        self.tree_branches = tree_branches if tree_branches >= 2 else 0
        n_seq = max(self.tree_branches + 1, 2 if scratch else 1, self.n_parallel)
        params.n_seq_max = n_seq
        # llama.cpp reserves an output per sequence at creation, and asserts they fit
        params.n_outputs_max = max(params.n_outputs_max, n_seq)
        # A tree's or a scratch sequence's tokens share cells with sequence 0; parallel
        # sequences each get a stream of their own (n_ctx_seq = n_ctx / n_seq_max) unless
        # asked to share.
        params.kv_unified = n_seq > 1 and (self.n_parallel == 1 or kv_unified)
        #: whether its sequences share one KV stream (a context over its cache, such as
        #: :class:`AssistantHead`'s, lays it out alike)
        self.kv_unified = bool(params.kv_unified)
        recurrent = model.memory != "attention"
        if recurrent and n_rs_seq > 0:
            # llama.cpp keeps a sequence's last n_rs_seq + 1 tokens in one micro-batch and
            # asserts (aborts) unless n_ubatch > n_rs_seq + 1 (src/llama-batch.cpp).
            n_rs_seq = min(n_rs_seq, params.n_batch - 2)
            params.n_ubatch = min(params.n_batch, max(params.n_ubatch, n_rs_seq + 2))
            params.n_rs_seq = max(0, n_rs_seq)
        params.n_threads = threads
        params.n_threads_batch = n_threads_batch or threads
        params.no_perf = True
        params.type_k = KV_CACHE_TYPES[type_k]
        #: the data type of the K cache (the V cache is f16), see :data:`KV_CACHE_TYPES`
        self.type_k = type_k
        ctx = lc.llama_init_from_model(model.handle, params)
        if not ctx:
            raise BackendError(
                f"llama.cpp could not create a context (n_ctx={n_ctx}, n_batch={n_batch}) "
                f"for {model.path.name}"
            )
        self._ctx = ctx
        model._contexts.add(self)
        #: KV-cache positions llama.cpp allocated (it rounds a request up, to 256 at least)
        self.n_ctx_allocated: int = lc.llama_n_ctx_seq(ctx)
        n_ctx = min(n_ctx, self.n_ctx_allocated - reserve) if n_ctx > 0 else 0
        #: positions this context uses: the size asked for (0: what llama.cpp chose), one
        #: fewer when nothing is left for deterministic mode's throw-away row
        self.n_ctx: int = min(n_ctx, self.n_ctx_allocated) if n_ctx > 0 else self.n_ctx_allocated
        self._rows_per_decode: int | None = None
        self._lone_rows_max = 0
        self.n_batch: int = lc.llama_n_batch(ctx)
        #: rows per llama.cpp graph evaluation (a batch's micro-batches)
        self.n_ubatch: int = lc.llama_n_ubatch(ctx)
        self.n_outputs_max = min(n_outputs_max, self.n_batch)
        self.n_vocab: int = model.n_vocab
        self.n_past = 0
        self.eval_seconds = 0.0  # wall time inside llama_decode and logits access
        self._mem = lc.llama_get_memory(ctx)
        #: whether the memory holds a recurrent state (a recurrent or hybrid model)
        self.recurrent = recurrent
        #: recurrent-state snapshots per sequence llama.cpp keeps (0: none, or no state)
        self.n_rs_seq: int = int(lc.llama_n_rs_seq(ctx)) if recurrent else 0
        #: whether a verification's rejected rows are dropped by checkpoint and replay (a
        #: recurrent state without snapshots, asked for with ``replay``)
        self.replays = replay and recurrent and not self.n_rs_seq
        # The recurrent state before the latest verification (its position, or -1: none
        # that can be gone back to) and the buffer it is copied into, reused.
        self._step_at = -1
        self._step_joined = False  # whether that verification began with _pending rows
        self._step_buf: Any = None
        self._step_len = 0
        # The last _pending of the n_past positions are kept but not decoded yet (their
        # tokens in _held): after a rollback by replay, the state and the cache end
        # before them, the step buffer holds that state, and the next evaluation decodes
        # them in its own batch.
        self._pending = 0
        self._room = 0  # positions the latest decode's snapshots (or _step_at) can drop
        self._scratch_ok = scratch
        self._seq = 0  # the sequence eval() writes: 1 inside scratch()
        self._home = 0  # the sequence of the committed text (see sequence())
        #: the media the cache holds (see :meth:`reuse`), by their first position
        self._media = {}
        self._media_batch: Any = None
        self._media_pos: Any = None
        # the token at each cached position, to decode again past the snapshots
        self._held = np.zeros(self.n_ctx_allocated, np.int32)
        self._hidden = hidden or bool(layer_inputs)
        self._hidden_rows: list[tuple[int, npt.NDArray[np.float32]]] = []
        self.n_embd_out: int = int(lc.llama_model_n_embd_out(model.handle))
        #: the layers whose inputs the hidden states are (empty: the output's)
        self.layer_inputs = tuple(layer_inputs)
        #: the width of a hidden state (:meth:`hidden_rows`)
        self.n_hidden = self.n_embd_out * max(1, len(self.layer_inputs))
        if self._hidden:
            from llama_cpp import llama_cpp_ext

            n_layer = int(lc.llama_model_n_layer(model.handle))
            if any(not 0 <= lid < n_layer for lid in layer_inputs):
                self._free()
                raise BackendError(f"{model.path.name} has {n_layer} layers, not layers "
                                   f"{list(layer_inputs)}")  # fmt: skip
            if layer_inputs and model.architecture not in LAYER_INPUT_ARCHS:
                # (llama.cpp asserts, and aborts the process, at the first decode)
                self._free()
                raise BackendError(f"llama.cpp keeps no layer inputs of a {model.architecture} "
                                   f"model ({model.path.name})")  # fmt: skip
            for lid in self.layer_inputs or (n_layer,):
                if lid >= n_layer:  # (no layer inputs: the output's hidden state)
                    llama_cpp_ext.llama_set_embeddings_nextn(ctx, True, False)
                else:
                    _ext()["set_layer_inp"](ctx, lid, True)
            self._nextn = llama_cpp_ext.llama_get_embeddings_nextn
            self._n_layer = n_layer
        self._batch = lc.llama_batch_init(self.n_batch, 0, n_seq)
        #: a tree evaluated and not yet resolved: (its root's position, the number of
        #: branch sequences, the branch sequence of each node, the root and the nodes)
        self._tree: tuple[int, int, list[int], list[int]] | None = None
        #: checkpoints a recurrent state keeps (0: none; see :meth:`prompt`)
        self.n_checkpoints = n_checkpoints if recurrent else 0
        self._checkpoints: list[Checkpoint] = []
        # Positions computed exactly as a fresh read of the same tokens computes them (in
        # whole micro-batches aligned on multiples of _exact_unit: see reuse()), and that unit.
        self._exact_to = 0
        self._exact_unit = self.n_ubatch if self.n_batch % self.n_ubatch == 0 else self.n_batch
        b = self._batch
        #: rows llama.cpp's logits buffer holds (see :meth:`_logits`), and its views
        self._logits_rows = params.n_outputs_max
        self._logits_views: dict[int, npt.NDArray[np.float32]] = {}
        self._no_logits = np.empty((0, self.n_vocab), np.float32)
        self._no_logits.flags.writeable = False
        self._iota = np.arange(self.n_batch, dtype=np.int32)
        self._tok = np.ctypeslib.as_array(b.token, shape=(self.n_batch,))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(self.n_batch,))
        self._nseq = np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))
        # the same columns as ctypes arrays: a few rows are filled faster through these
        # than through numpy's slicing
        self._ctok = (ctypes.c_int32 * self.n_batch).from_address(
            ctypes.addressof(b.token.contents)
        )
        self._cpos = (ctypes.c_int32 * self.n_batch).from_address(ctypes.addressof(b.pos.contents))
        self._cout = (ctypes.c_int8 * self.n_batch).from_address(
            ctypes.addressof(b.logits.contents)
        )
        self._nseq[:] = 1
        for i in range(self.n_batch):
            b.seq_id[i][0] = 0

    def eval(
        self,
        tokens: Sequence[int],
        *,
        logits: Literal["last", "all", "none"] = "last",
    ) -> npt.NDArray[np.float32]:
        """Append ``tokens`` at positions ``n_past ...`` and return the logits requested.

        Tokens beyond ``n_batch`` are decoded in several batches. Returns a read-only
        ``float32[n_out, n_vocab]`` array of logits: ``n_out`` is 1 for "last",
        ``len(tokens)`` for "all" (only allowed when it fits one batch), 0 for "none";
        a view of llama.cpp's output buffer, valid until the next ``eval``.

        With ``rows_per_decode`` set (deterministic mode), an evaluation that returns
        logits is decoded in batches of 2 to ``rows_per_decode`` rows, a lone row with a
        throw-away second row after it (removed again) unless it leaves at most
        ``lone_rows_max`` positions cached, so that every row's logits come from the same
        kernels whatever the number of tokens (see :mod:`specgguf.llama.invariance`).

        Raises:
            ContextOverflowError: the tokens do not fit the KV cache.
            BackendError: llama_decode failed.
        """
        if self._tree is not None:  # a tree left unresolved is dropped
            self._drop_tree(self._tree[1])
        n = len(tokens)
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(
                self.n_past + n, self.n_ctx, prompt=False, model=self.model.path.name
            )
        if logits == "all" and n > self.n_outputs_max:
            raise ValueError(f"logits='all' allows at most n_outputs_max={self.n_outputs_max}")
        t0 = time.perf_counter()
        self._step_at = -1
        # a verification on a state without snapshots: the state before it is kept
        step = self.replays and logits == "all" and n >= 2 and self._seq == self._home
        try:
            p = self._pending
            if p and (self.rows_per_decode or (logits == "all" and p + n > self.n_batch)):
                self._flush()
                p = 0
            if p:  # the rows kept of the last verification go first, without logits
                self.n_past -= p
                self._pending = 0
                tokens = [*self._held[self.n_past : self.n_past + p].tolist(), *tokens]
            elif step:  # (after a replay, the step buffer already holds this state)
                self._keep_step()
            at = self.n_past
            if self.rows_per_decode and logits != "none" and n:
                return self._eval_rows(tokens, logits == "all")
            n_out = 0
            for start in range(0, p + n, self.n_batch):
                chunk = tokens[start : start + self.n_batch]
                last = start + len(chunk) == p + n
                if logits == "all":
                    n_out = self._decode(chunk, outputs="all", skip=p)
                else:
                    n_out = self._decode(
                        chunk, outputs="last" if logits == "last" and last else "none"
                    )
            out = self._logits(0, n_out)
            if step:
                self._step_at, self._room, self._step_joined = at, p + n, p > 0
            return out
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def eval_lone(self, token: int) -> npt.NDArray[np.float32]:
        """:meth:`eval` of one token, its logits returned: a read-only ``float32[n_vocab]``
        view of llama.cpp's output buffer, valid until the next evaluation. The target
        alone's step calls it once a token; it decodes as :meth:`eval` does, without
        eval's general case where nothing calls for it (a tree left, rows kept from a
        verification, deterministic mode's batches, hidden states read), whose Python
        costs a few per cent of a fast target's step (docs/performance.md).

        Raises:
            ContextOverflowError: no position is left in the KV cache.
            BackendError: llama_decode failed.
        """
        if self._tree is not None or self._pending or self._rows_per_decode or self._hidden:
            row: npt.NDArray[np.float32] = self.eval([token], logits="all")[0]
            return row
        n_past = self.n_past
        if n_past >= self.n_ctx:
            raise ContextOverflowError(
                n_past + 1, self.n_ctx, prompt=False, model=self.model.path.name
            )
        t0 = time.perf_counter()
        self._step_at = -1
        if self.n_parallel > 1:  # the batch is shared by the sequences
            self._batch.seq_id[0][0] = self._seq
        self._tok[0] = token
        self._pos[0] = n_past - self._shift
        self._out[0] = 1
        self._batch.n_tokens = 1
        try:
            rc = self._lc.llama_decode(self._ctx, self._batch)
            if rc != 0:
                self._decode_failed(1, rc)
            self._held[n_past] = token
            self.n_past = n_past + 1
            self._room = 0
            row = self._logits(0, 1)[0]
            return row
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def _logits(self, first: int, n_out: int) -> npt.NDArray[np.float32]:
        """Output rows ``first`` to ``first + n_out`` of the latest decode: a read-only
        view of llama.cpp's logits buffer, valid until the next decode. The buffer's view
        is made once per address it has had (a view made afresh cost more than the rest
        of a lone row's reading)."""
        if not n_out:
            return self._no_logits
        ptr = self._lc.llama_get_logits(self._ctx)
        address = ctypes.addressof(ptr.contents)
        view = self._logits_views.get(address)
        if view is None:
            view = np.ctypeslib.as_array(ptr, shape=(self._logits_rows, self.n_vocab))
            view.flags.writeable = False
            self._logits_views[address] = view
        return view[first : first + n_out]

    def _read_hidden(self, rows: int) -> npt.NDArray[np.float32]:
        """The hidden states of the latest decode's ``rows`` rows, in the batch's order:
        float32[rows, n_hidden], a copy (each of :attr:`layer_inputs`' input rows side by
        side, or the output's)."""
        parts = []
        for lid in self.layer_inputs or (self._n_layer,):
            ptr = (self._nextn(self._ctx) if lid >= self._n_layer
                   else _ext()["get_layer_inp"](self._ctx, lid))  # fmt: skip
            if not ptr:
                raise BackendError(f"llama.cpp kept no hidden states of layer {lid} of "
                                   f"{self.model.path.name}")  # fmt: skip
            parts.append(np.ctypeslib.as_array(ptr, shape=(rows, self.n_embd_out)))
        return np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0].copy()

    def _keep_step(self) -> None:
        """Copy the recurrent state at ``n_past`` into the step buffer (checkpoint and
        replay: see the class).

        Raises:
            BackendError: llama.cpp could not copy it.
        """
        lc, ctx = self._lc, self._ctx
        size = lc.llama_state_seq_get_size_ext(ctx, self._home, _STATE_PARTIAL)
        if self._step_buf is None or len(self._step_buf) < size:
            self._step_buf = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data_ext(ctx, self._step_buf, size, self._home,
                                                  _STATE_PARTIAL)  # fmt: skip
        if written == 0 and size:
            raise BackendError(f"llama.cpp could not copy the state of {self.model.path.name}")
        self._step_len = written

    def _replay(self, n_keep: int) -> bool:
        """Go back to the state before the latest verification and keep its rows up to
        ``n_keep``: in the next evaluation's batch (:attr:`_pending`), which costs the rows
        a batch adds rather than a decode of their own; decoded again at once where the
        hidden states are kept (the MTP layers read them before the next evaluation), or
        where that verification itself began with rows kept so (a second rejection in a
        row: deferred again, the rows since the copy would pile up, each verification
        decoding them all). False where llama.cpp refused the state (nothing changed)."""
        at = self._step_at
        self._step_at = -1
        lc = self._lc
        if not lc.llama_state_seq_set_data_ext(self._ctx, self._step_buf, self._step_len,
                                               self._home, _STATE_PARTIAL):  # fmt: skip
            return False
        if not lc.llama_memory_seq_rm(self._mem, self._home, at - self._shift, -1):
            return False
        self._cut_hidden(at)
        self.n_past, self._pending = n_keep, n_keep - at
        if self._hidden or self._step_joined:
            self._flush()
        return True

    def _flush(self) -> None:
        """Decode the positions kept but not decoded yet (:attr:`_pending`), now.

        Raises:
            BackendError: llama_decode failed.
        """
        p = self._pending
        if not p:
            return
        self.n_past -= p
        self._pending = 0
        kept = self._held[self.n_past : self.n_past + p].tolist()
        for start in range(0, p, self.n_batch):
            self._decode(kept[start : start + self.n_batch], outputs="none")

    def replay_seconds(self, repeats: int = 5) -> tuple[float, float]:
        """Seconds to copy the recurrent state before a verification and to load it back
        (the least of ``repeats`` of each; the replayed rows cost what decoding them does),
        measured on a state of a few positions, which it leaves empty. (0, 0) where the
        context does not replay.

        Raises:
            BackendError: llama.cpp could not copy or load the state.
        """
        if not self.replays:
            return 0.0, 0.0
        self.rollback(0)
        self.eval([0, 0, 0, 0], logits="none")
        save = restore = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            self._keep_step()
            t1 = time.perf_counter()
            self._step_at = self.n_past
            if not self._replay(self.n_past):
                raise BackendError(f"llama.cpp could not load a copied state of "
                                   f"{self.model.path.name}")  # fmt: skip
            save, restore = min(save, t1 - t0), min(restore, time.perf_counter() - t1)
        self.rollback(0)
        return save, restore

    def _decode(
        self,
        chunk: Sequence[int],
        *,
        outputs: Literal["all", "last", "none"],
        pad: bool = False,
        skip: int = 0,
    ) -> int:
        """One ``llama_decode`` of ``chunk`` at ``n_past`` (and, with ``pad``, a throw-away
        row after it, removed again; "all" outputs but the first ``skip`` rows); returns
        the number of output rows."""
        m = len(chunk)
        rows = m + pad
        if self.n_parallel > 1:  # the batch is shared by the sequences
            seq_id = self._batch.seq_id
            for i in range(rows):
                seq_id[i][0] = self._seq
        if rows == 1:  # (a step of the target alone: numpy's slicing costs more)
            self._tok[0] = chunk[0]
            self._pos[0] = self.n_past - self._shift
            self._out[0] = outputs != "none" and not skip
        elif rows <= _FEW_ROWS:  # a step's rows: through ctypes, cheaper than numpy here
            self._ctok[:m] = chunk
            if pad:
                self._ctok[m] = chunk[-1]
            p = self.n_past - self._shift
            self._cpos[:rows] = range(p, p + rows)
            flags = [0] * skip + [int(outputs == "all")] * (rows - skip)
            if outputs == "last":
                flags[m - 1] = 1
            if pad:
                flags[m] = 0
            self._cout[:rows] = flags
        else:  # a prompt's chunk: numpy's slicing, cheaper for many rows
            self._tok[:m] = chunk
            if pad:
                self._tok[m] = chunk[-1]
            np.add(self._iota[:rows], self.n_past - self._shift, out=self._pos[:rows])
            self._out[:rows] = 1 if outputs == "all" else 0
            self._out[:skip] = 0
            if outputs == "last":
                self._out[m - 1] = 1
            if pad:
                self._out[m] = 0
        self._batch.n_tokens = rows
        rc = self._lc.llama_decode(self._ctx, self._batch)
        if rc != 0:
            self._decode_failed(m, rc)
        if m == 1:
            self._held[self.n_past] = chunk[0]
        else:
            self._held[self.n_past : self.n_past + m] = chunk
        if self._hidden:
            self._hidden_rows.append((self.n_past, self._read_hidden(rows)[:m]))
        self.n_past += m
        self._room = min(self.n_rs_seq, rows - 1)
        if pad:
            self._truncate(self.n_past)
        return m - skip if outputs == "all" else int(outputs == "last")

    def _decode_failed(self, m: int, rc: int = -1) -> NoReturn:
        """After a failed ``llama_decode`` of ``m`` tokens at ``n_past`` (code ``rc``):
        llama.cpp restores the cache or keeps the micro-batches it processed, so anything
        past what is committed is removed (a recurrent state, which a cut cannot shorten
        and whose snapshots may not reach there, is read again).

        Raises:
            BackendError: always.
        """
        self._truncate(self.n_past, reread=self.recurrent)
        raise BackendError(
            f"llama_decode failed with code {rc} on {self.model.path.name} "
            f"({m} tokens at position {self.n_past})"
        )

    def _eval_rows(self, tokens: Sequence[int], all_rows: bool) -> npt.NDArray[np.float32]:
        """``eval`` in decode calls of 2 to ``rows_per_decode`` rows, sizes as even as
        possible (a lone row padded); the logits rows copied out of llama.cpp's buffer."""
        n, r = len(tokens), self.rows_per_decode
        assert r is not None and r >= 2
        n_calls = -(-n // r)
        out = np.empty((n if all_rows else 1, self.n_vocab), np.float32)
        done = 0
        for i in range(n_calls):
            size = n // n_calls + (i < n % n_calls)
            chunk = tokens[done : done + size]
            last = done + size == n
            want: Literal["all", "last", "none"] = "all" if all_rows else "last" if last else "none"
            pad = size == 1 and self.n_past + 1 > self.lone_rows_max
            self._decode(chunk, outputs=want, pad=pad)
            if all_rows:
                out[done : done + size] = self._logits(0, size)
            elif last:
                out[0] = self._logits(0, 1)[0]
            done += size
        out.flags.writeable = False
        return out

    def eval_tree(
        self, root: int, tokens: Sequence[int], parents: Sequence[int]
    ) -> npt.NDArray[np.float32]:
        """Evaluate a token tree in one ``llama_decode`` and return the logits after every
        node (tree attention, SpecInfer, Miao et al. 2023, section 4).

        ``root`` is the next committed token (at position ``n_past``); ``tokens[i]`` is a
        draft token whose parent is ``tokens[parents[i]]``, or the root for -1 (parents
        first, see :mod:`specgguf.speculative.tree`), at position ``n_past + depth``. Each leaf is
        a llama.cpp sequence 1..L that first receives the committed text (sequence 0, by
        ``llama_memory_seq_cp``: cell metadata only, in a unified cache); a node belongs to
        the sequences of the leaves under it and the root to all, sequence 0 included.
        llama.cpp builds a token's attention mask from its first sequence id
        (``set_input_kq_mask`` in src/llama-kv-cache.cpp): each node's first id is a leaf
        under it, whose cells are the committed text and the node's own ancestors.

        The tree stays in the cache until :meth:`keep_tree_path` keeps one branch of it, or
        :meth:`rollback` drops it; ``n_past`` is unchanged until then.

        Returns:
            read-only float32[1 + len(tokens), n_vocab]: row 0 after the root, row i + 1
            after ``tokens[i]``; a view valid until the next evaluation.

        Raises:
            ValueError: no trees on this context (``tree_branches``), a malformed tree,
                more leaves than ``tree_branches``, more rows than ``n_outputs_max``.
            ContextOverflowError: the tree does not fit the KV cache.
            BackendError: llama_decode failed (the cache is left as before the call).
        """
        if not self.tree_branches:
            raise ValueError("this context was created without token trees (tree_branches)")
        if self._tree is not None:
            raise ValueError("a tree is pending: keep a path of it or roll back first")
        if len(parents) != len(tokens):
            raise ValueError(f"{len(tokens)} tokens and {len(parents)} parents")
        depth = [0]  # by row: the root's, then each token's
        has_child = [False] * len(tokens)
        for i, p in enumerate(parents):
            if not -1 <= p < i:
                raise ValueError(f"node {i} has parent {p}: a parent must be -1 or earlier")
            depth.append(depth[p + 1] + 1)
            if p >= 0:
                has_child[p] = True
        tips = [i for i, c in enumerate(has_child) if not c] or [-1]  # a lone root: a leaf
        if len(tips) > self.tree_branches:
            raise ValueError(f"a tree of {len(tips)} leaves; this context verifies at most "
                             f"{self.tree_branches}")  # fmt: skip
        rows = len(tokens) + 1
        if rows > self.n_outputs_max:
            raise ValueError(f"a tree of {rows} rows; at most n_outputs_max={self.n_outputs_max}")
        if self.n_past + max(depth) + 1 > self.n_ctx:
            raise ContextOverflowError(
                self.n_past + max(depth) + 1, self.n_ctx, prompt=False, model=self.model.path.name
            )
        # The sequences of each row (row 0: the root, row i + 1: tokens[i]), first the
        # lowest leaf under it; the root also belongs to sequence 0.
        seqs: list[list[int]] = [[] for _ in range(rows)]
        for s, leaf in enumerate(tips, start=1):
            node = leaf
            while node >= 0:
                seqs[node + 1].append(s)
                node = parents[node]
            seqs[0].append(s)
        seqs[0].append(0)
        lc, b, n_seq = self._lc, self._batch, len(tips)
        t0 = time.perf_counter()
        try:
            for s in range(1, n_seq + 1):
                lc.llama_memory_seq_cp(self._mem, 0, s, -1, -1)
            self._tok[0] = root
            self._tok[1:rows] = tokens
            self._pos[:rows] = np.asarray(depth, np.int32) + (self.n_past - self._shift)
            self._out[:rows] = 1
            for i, ids in enumerate(seqs):
                self._nseq[i] = len(ids)
                for j, s in enumerate(ids):
                    b.seq_id[i][j] = s
            b.n_tokens = rows
            rc = lc.llama_decode(self._ctx, b)
            # The batch's other rows stay those of sequence 0 alone, for eval().
            self._nseq[:rows] = 1
            for i in range(rows):
                b.seq_id[i][0] = 0
            if rc != 0:
                self._drop_tree(n_seq)
                raise BackendError(
                    f"llama_decode failed with code {rc} on {self.model.path.name} "
                    f"(a tree of {rows} tokens at position {self.n_past})"
                )
            # The branch sequence under each node: its first id (the root: any leaf's).
            self._tree = (self.n_past, n_seq, [ids[0] for ids in seqs], [root, *tokens])
            return self._logits(0, rows)
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def keep_tree_path(self, path: Sequence[int]) -> None:
        """Keep the root and the branch ``path`` (node indices from the root down, as
        :func:`specgguf.speculative.tree.accept_greedy` gives) of the tree :meth:`eval_tree`
        evaluated, in sequence 0, and drop the rest: ``n_past`` grows by
        ``1 + len(path)``.

        Raises:
            ValueError: no tree is pending.
        """
        if self._tree is None:
            raise ValueError("no tree is pending")
        start, n_seq, leaf_of, nodes = self._tree
        if path:
            # The cells of a leaf's sequence past the root are its branch, one per position:
            # those up to the last accepted node are the path.
            s = leaf_of[path[-1] + 1]
            p = start - self._shift
            self._lc.llama_memory_seq_cp(self._mem, s, 0, p + 1, p + 1 + len(path))
        self._drop_tree(n_seq, keep_root=True)
        kept = [nodes[0], *(nodes[i + 1] for i in path)]  # the root, then the branch
        self._held[start : start + len(kept)] = kept
        self.n_past = start + len(kept)

    def _drop_tree(self, n_seq: int, *, keep_root: bool = False) -> None:
        """Remove the branch sequences 1..n_seq, and unless ``keep_root`` sequence 0's
        cells past ``n_past`` (the root)."""
        for s in range(1, n_seq + 1):
            self._lc.llama_memory_seq_rm(self._mem, s, -1, -1)
        if not keep_root:
            self._lc.llama_memory_seq_rm(self._mem, 0, self.n_past - self._shift, -1)
        self._tree = None

    @property
    def rows_per_decode(self) -> int | None:
        """Deterministic mode: the most rows per ``llama_decode`` when logits are returned
        (None: any number); set with :meth:`set_rows_per_decode`."""
        return self._rows_per_decode

    @property
    def lone_rows_max(self) -> int:
        """Deterministic mode: a lone row is decoded without a throw-away second row while
        it leaves at most this many positions cached (0: always padded); set with
        :meth:`set_lone_rows_max`."""
        return self._lone_rows_max

    def set_lone_rows_max(self, n: int) -> None:
        """Set :attr:`lone_rows_max`.

        Raises:
            ValueError: a negative number.
        """
        if n < 0:
            raise ValueError(f"lone_rows_max must be 0 or more, not {n}")
        self._lone_rows_max = n

    def set_rows_per_decode(self, rows: int | None) -> None:
        """Deterministic mode on (``rows``: 2 or more, see :meth:`eval`) or off (None).

        Raises:
            ValueError: fewer than 2 rows, more than fit a batch, or no position left for
                the throw-away row.
        """
        if rows is not None:
            if not 2 <= rows <= self.n_batch:
                raise ValueError(f"rows per decode must be 2..{self.n_batch}, not {rows}")
            if self.n_ctx >= self.n_ctx_allocated:
                raise ValueError("deterministic mode needs one KV position beyond n_ctx")
        self._rows_per_decode = rows

    @property
    def replays_lazily(self) -> bool:
        """Whether the rows a replay keeps are decoded in the next evaluation's batch
        (checkpoint and replay without hidden states; with them, at once)."""
        return self.replays and not self._hidden

    @property
    def rollback_max(self) -> int | None:
        """The most positions a rollback right after a decode can drop without decoding
        the rest again: None (any) for a KV cache alone, else :attr:`n_rs_seq`, or the
        batch with checkpoint and replay (:attr:`replays`)."""
        if not self.recurrent:
            return None
        return self.n_batch if self.replays else self.n_rs_seq

    @property
    def rollback_room(self) -> int | None:
        """How many positions :meth:`rollback` can drop now without decoding anything
        again: None (any) for a KV cache alone, else what the recurrent state's snapshots
        of the latest decode allow (0 after a rollback, until the next decode); with
        checkpoint and replay, the latest verification's rows (the kept ones of which
        are decoded again)."""
        return None if not self.recurrent else self._room

    def rollback(self, n_keep: int) -> None:
        """Drop every KV-cache position from ``n_keep`` on, so that ``n_past == n_keep``
        (and a tree :meth:`eval_tree` left, whole). On a recurrent state, deeper than
        :attr:`rollback_room`, the sequence is cleared and its first ``n_keep`` tokens are
        decoded again.

        Raises:
            ValueError: ``n_keep`` is negative or beyond ``n_past``.
            BackendError: decoding the kept tokens again failed.
        """
        if self._tree is not None:  # a tree evaluated and not kept is dropped
            self._drop_tree(self._tree[1])
        if not 0 <= n_keep <= self.n_past:
            raise ValueError(f"cannot roll back to {n_keep} with {self.n_past} positions")
        if n_keep == self.n_past:
            return
        t0 = time.perf_counter()
        try:
            self._truncate(n_keep)
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def _truncate(self, n_keep: int, *, reread: bool = False) -> None:
        """Cut sequence 0 to ``n_keep`` positions: by llama.cpp's ``seq_rm`` where the
        memory allows it, else (or with ``reread``) by clearing it and decoding its tokens
        again."""
        media = self._media
        if media:
            self._media = {p: m for p, m in media.items() if m.end <= n_keep}
        self._forget_past(n_keep)
        # (a cut chunk is copied: a view would keep the dropped rows' memory)
        self._cut_hidden(n_keep)
        if self._pending:
            base = self.n_past - self._pending
            if n_keep >= base:  # within what is not decoded yet
                self.n_past, self._pending, self._room = n_keep, n_keep - base, 0
                return
            self.n_past, self._pending = base, 0
        depth = self.n_past - n_keep
        room = self.rollback_room
        if self._step_at >= 0:  # checkpoint and replay
            if not reread and self._step_at <= n_keep and self._replay(n_keep):
                self._room = 0
                return
            room = 0
        if n_keep > 0 and (reread or (room is not None and depth > room)):
            ok = False  # beyond the snapshots: llama.cpp could restore a stale one
        else:
            ok = bool(self._lc.llama_memory_seq_rm(self._mem, self._home, n_keep - self._shift, -1))
        self._room = 0
        if ok:
            self.n_past = n_keep
            return
        log.debug("%s: rolling back %d positions past the recurrent state's snapshots: "
                  "decoding %d tokens again", self.model.path.name, depth, n_keep)  # fmt: skip
        kept = self._held[:n_keep].tolist()
        spans = sorted(self._media.values(), key=lambda m: m.start)
        self._lc.llama_memory_seq_rm(self._mem, self._home, -1, -1)
        self.n_past = 0
        self._hidden_rows = []
        self._media = {}
        # (a medium's positions hold placeholder tokens: its rows are read again as rows)
        for at, end in _text_runs(0, n_keep, spans):
            if at < 0:
                self._read_media(spans[-at - 1], kept[spans[-at - 1].start : end])
                continue
            for start in range(at, end, self.n_batch):
                self._decode(kept[start : min(end, start + self.n_batch)], outputs="none")

    # -- what the sequence holds across generations -------------------------------------

    def cached_prefix(self, tokens: Sequence[int], media: Sequence[object] = ()) -> int:
        """How many leading ``tokens`` the sequence's cache holds (the longest common
        prefix of its tokens and ``tokens``), whether or not it can be cut there; where
        the cache or the prompt holds media (``media``: the prompt's
        :class:`~specgguf.llama.media.MediaSpan`\\ s), only up to the first medium they
        do not share (the placeholder tokens are the same whatever the image)."""
        n = min(self.n_past, len(tokens))
        if n == 0:
            return 0
        differ = np.flatnonzero(self._held[:n] != np.asarray(tokens[:n], np.int32))
        n = int(differ[0]) if len(differ) else n
        return self._media_prefix(n, _spans(media)) if media or self._media else n

    def reuse(
        self, tokens: Sequence[int], *, exact: bool = False, media: Sequence[object] = ()
    ) -> int:
        """Keep the longest prefix of ``tokens`` the cache holds and can be cut to, drop
        the rest, and return its length (the new ``n_past``): llama-server's
        ``cache_prompt`` (tools/server/server-context.cpp). A recurrent state goes back
        within its snapshots (:attr:`rollback_room`), else to the deepest checkpoint at
        or below the shared prefix, else to nothing. A sliding-window cache that has
        forgotten positions the window at the cut needs is dropped whole (on a hybrid
        model with sliding-window layers, any cut past its snapshots).

        ``exact``: keep only positions computed as a fresh read of the same tokens
        computes them (read by :meth:`prompt` with ``exact``, in micro-batches aligned
        from position 0), cut on a micro-batch boundary, so that reading the rest gives
        bit-identical logits (deterministic mode).

        ``media`` (:class:`~specgguf.llama.media.MediaSpan`\\ s): the prompt's media; the
        prefix kept ends before the first medium the cache and the prompt do not share
        (the placeholder tokens are the same whatever the image).
        """
        if self._tree is not None:
            self._drop_tree(self._tree[1])
        n = self.cached_prefix(tokens, media)
        if exact:
            n = min(n, self._exact_to)
            n -= n % self._exact_unit
        if n > 0 and self.model.n_swa > 0:
            if self.recurrent:
                # (its memory's pos_min is the recurrent state's: only a cut within the
                # snapshots, which keep the window as it was, is known to be sound)
                if self.n_past - n > self._room:
                    n = 0
            else:
                pos_min = int(self._lc.llama_memory_seq_pos_min(self._mem, self._home))
                if pos_min > max(0, n - self._shift_at(n) - self.model.n_swa):
                    n = 0
        t0 = time.perf_counter()
        try:
            # (a KV cache is cut anywhere; a recurrent state at its end or within its
            # snapshots)
            if not self.recurrent or n >= self.n_past - max(self._room, self._pending):
                self._cut(n)
            else:
                # (deterministic mode is never asked of a recurrent state: preflight
                # refuses it, so no checkpoint needs to be exact)
                ok = [c for c in self._checkpoints if c.n <= n]
                n = 0
                if not ok:
                    self._cut(0)
                else:
                    try:
                        self._restore(ok[-1])
                        n = ok[-1].n
                    except BackendError as e:  # (the sequence is empty then)
                        log.warning("%s; the prompt is read whole", e)
        finally:
            self.eval_seconds += time.perf_counter() - t0
        return n

    def _cut(self, n: int) -> None:
        """Drop the positions from ``n`` on (a recurrent state: within its snapshots, or
        to 0) and the checkpoints past them."""
        if n < self.n_past:
            self._truncate(n)
        self._forget_past(n)

    def _cut_hidden(self, n: int) -> None:
        """Drop the hidden states of positions from ``n`` on (a cut chunk is copied: a
        view would keep the dropped rows' memory)."""
        self._hidden_rows = [(p, h if p + len(h) <= n else h[: n - p].copy())
                             for p, h in self._hidden_rows if p < n]  # fmt: skip

    def _forget_past(self, n: int) -> None:
        self._checkpoints = [c for c in self._checkpoints if c.n <= n]
        self._exact_to = min(self._exact_to, n)

    def _restore(self, checkpoint: Checkpoint) -> None:
        """Go back to ``checkpoint``: its recurrent state, and the KV cache cut there."""
        n = checkpoint.n
        restored = self._set_state(checkpoint.data, partial=True)
        if not restored or not self._lc.llama_memory_seq_rm(self._mem, self._home,
                                                            n - self._shift_at(n), -1):  # fmt: skip
            self._lc.llama_memory_seq_rm(self._mem, self._home, -1, -1)
            self.n_past = 0
            self._hidden_rows = []
            self._forget_past(0)
            raise BackendError(f"llama.cpp could not restore a checkpoint of "
                               f"{self.model.path.name} at {n} positions")  # fmt: skip
        self.n_past = n
        self._room = 0
        self._cut_hidden(n)
        self._step_at, self._pending = -1, 0
        self._forget_past(n)
        if self._media:
            self._media = {p: m for p, m in self._media.items() if m.end <= n}

    def prompt(
        self,
        tokens: Sequence[int],
        evaluate: Callable[[Sequence[int]], object] | None = None,
        *,
        exact: bool = False,
        media: Sequence[object] = (),
        alone: Callable[[Callable[[], None]], None] | None = None,
    ) -> None:
        """Append a prompt's ``tokens`` (no logits) with ``evaluate`` (default
        ``eval(tokens, logits="none")``; a parallel sequence passes its batcher's), and
        ``media``'s embeddings at their positions, each read by a decode of its own that
        ``alone`` makes (called with the read; default: at once; a parallel sequence's
        batcher makes it between its batches, whose logits it would overwrite). A
        recurrent state with ``n_checkpoints`` keeps a checkpoint after them,
        :data:`CHECKPOINT_TAIL` positions before their end, and at every multiple of
        :data:`CHECKPOINT_STEP` positions on the way. ``exact``: deterministic mode reads
        the prompt (the evaluation decodes it alone, in batches of ``n_batch`` from where it
        starts), and :meth:`reuse` in ``exact`` mode may keep the whole micro-batches it
        reads from a micro-batch boundary on.

        Raises:
            ContextOverflowError: the tokens do not fit.
            BackendError: llama_decode failed, or a checkpoint could not be copied.
        """
        if not tokens:
            return
        start, end = self.n_past, self.n_past + len(tokens)
        read = evaluate or (lambda t: self.eval(t, logits="none"))
        here = [m for m in _spans(media) if m.end > start and m.start < end]
        if here:
            self._prompt_with_media(tokens, here, read, alone)
            return
        unit = self._exact_unit
        cuts = [end]
        if self.n_checkpoints:
            # on micro-batch boundaries (reads stay exact), and a few tokens before the end
            # (llama-server's): a prompt that ends otherwise (a template's generation
            # prompt, or one that needs the position before the end read again) goes back
            # there, not to the one before
            step = max(unit, CHECKPOINT_STEP // unit * unit)
            tail = [end - CHECKPOINT_TAIL] if end - CHECKPOINT_TAIL > start else []
            cuts = sorted({*range((start // step + 1) * step, end, step), *tail, end})
        at = start
        for cut in cuts:
            read(tokens[at - start : cut - start])
            at = cut
            if self.n_checkpoints:
                self.checkpoint()
        if exact and start <= self._exact_to and start % unit == 0 and not self.n_checkpoints:
            self._exact_to = end - end % unit
        else:  # (a recurrent state's reads are never exact: see reuse)
            self._exact_to = min(self._exact_to, start)

    @property
    def media_end(self) -> int:
        """The position after the last medium's rows the cache holds (0: none)."""
        return max((m.end for m in self._media.values()), default=0)

    @property
    def holds_media(self) -> bool:
        """Whether some of the cached positions hold a medium's rows (their tokens are
        placeholders)."""
        return bool(self._media)

    @property
    def _media(self) -> dict[int, MediaSpan]:
        """The media the cache holds, by first row."""
        return self._media_held

    @_media.setter
    def _media(self, media: dict[int, MediaSpan]) -> None:
        self._media_held = media
        #: rows less positions over the media held (M-RoPE): row n_past is at position
        #: n_past - _shift (every held medium ends before n_past)
        self._shift = sum(m.shift for m in media.values()) if media else 0

    def _shift_at(self, n: int) -> int:
        """Rows less positions over the held media that end by row ``n``."""
        return sum(m.shift for m in self._media.values() if m.end <= n)

    def media_keys(self) -> dict[int, bytes]:
        """The media the cache holds: each medium's (or 30 s chunk's) first position and
        its content's key (:attr:`MediaSpan.key`)."""
        return {p: m.key for p, m in self._media.items()}

    def _media_prefix(self, n: int, media: list[MediaSpan]) -> int:
        """:func:`media_prefix` of the media the cache holds and ``media``; a context that
        keeps hidden states cuts one position earlier, so that it computes the hidden
        state a head reads before that medium again."""
        return media_prefix(n, self._media.values(), media, before=self._hidden)

    def _prompt_with_media(
        self,
        tokens: Sequence[int],
        media: list[MediaSpan],
        read: Callable[[Sequence[int]], object],
        alone: Callable[[Callable[[], None]], None] | None,
    ) -> None:
        """:meth:`prompt` of ``tokens`` whose positions hold ``media``: the text between
        them read as tokens, each medium as its embeddings (through ``alone``, see
        :meth:`prompt`).

        Raises:
            BackendError: a medium not wholly inside the prompt, a recurrent state (its
                checkpoints are not taken here), a token tree's or scratch sequence, or a
                decode failure.
        """
        start = self.n_past
        end = start + len(tokens)
        if self._seq != self._home:
            raise BackendError(f"{self.model.path.name}: media are read only by a sequence "
                               f"outside a token tree")  # fmt: skip
        for m in media:
            if m.start < start or m.end > end:
                raise BackendError(f"a medium at positions {m.start}-{m.end} is not inside "
                                   f"the prompt read ({start}-{end})")  # fmt: skip
        for at, stop in _text_runs(start, end, media):
            if at >= 0:  # text: as any prompt's, a recurrent state's checkpoints included
                self.prompt(tokens[at - start : stop - start], read)
                continue
            m = media[-at - 1]
            medium = functools.partial(self._read_media, m, tokens[m.start - start : stop - start])
            if alone is None:
                medium()
            else:
                alone(medium)
            self.checkpoint()  # (a recurrent state: a prompt that shares the medium goes on)
        self._exact_to = min(self._exact_to, start)

    def _read_media(self, span: MediaSpan, placeholders: Sequence[int]) -> None:
        """Decode a medium's embeddings at its positions (no logits), in batches of
        ``n_batch`` rows, a non-causal one in one micro-batch with causal attention off
        (as libmtmd's ``mtmd_helper_decode_image_chunk``)."""
        self._flush()  # (rows kept by a rollback and not decoded yet come before it)
        n, width = len(span.embd), span.embd.shape[1]
        if span.non_causal and n > self.n_ubatch:
            raise BackendError(f"an image of {n} rows attends both ways and needs them in "
                               f"one micro-batch: n_ubatch is {self.n_ubatch}")  # fmt: skip
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(self.n_past + n, self.n_ctx, prompt=True,
                                       model=self.model.path.name)  # fmt: skip
        lc, owner = self._lc, self.base  # (the sequences' one batch, freed with the context)
        if owner._media_batch is None:
            owner._media_batch = lc.llama_batch_init(self.n_batch, width, 1)
            # (M-RoPE: four positions a row, section by section; llama_batch_init
            # allocates one, so the batch points at this array while such a medium is read)
            owner._media_pos = (ctypes.c_int32 * (4 * self.n_batch))()
        b = owner._media_batch
        emb = np.ctypeslib.as_array(b.embd, shape=(self.n_batch, width))
        # (the address, not the field: a field read is a view of the batch's memory)
        own_pos = ctypes.cast(b.pos, ctypes.c_void_p).value or 0
        if span.pos is not None:
            b.pos = ctypes.cast(owner._media_pos, ctypes.POINTER(ctypes.c_int32))
        pos = np.ctypeslib.as_array(
            b.pos, shape=(self.n_batch * (4 if span.pos is not None else 1),)
        )
        np.ctypeslib.as_array(b.n_seq_id, shape=(self.n_batch,))[:] = 1
        np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))[:] = 0
        t0 = time.perf_counter()
        rc = 0
        if span.non_causal:
            lc.llama_set_causal_attn(self._ctx, False)
        try:
            for at in range(0, n, self.n_batch):
                rows = min(self.n_batch, n - at)
                emb[:rows] = span.embd[at : at + rows]
                if span.pos is not None:
                    pos[: 4 * rows] = span.pos[:, at : at + rows].reshape(-1)
                else:
                    p = self.n_past - self._shift
                    pos[:rows] = np.arange(p, p + rows, dtype=np.int32)
                for i in range(rows):
                    b.seq_id[i][0] = self._seq
                b.n_tokens = rows
                rc = lc.llama_decode(self._ctx, b)
                if rc != 0:
                    break
                self._held[self.n_past : self.n_past + rows] = placeholders[at : at + rows]
                if self._hidden:  # (a head reads them: the hidden states that saw the medium)
                    self._hidden_rows.append((self.n_past, self._read_hidden(rows)))
                self.n_past += rows
        finally:
            b.pos = ctypes.cast(own_pos, ctypes.POINTER(ctypes.c_int32))
            if span.non_causal:
                lc.llama_set_causal_attn(self._ctx, True)
            self.eval_seconds += time.perf_counter() - t0
            self._room = 0  # (a recurrent state: no snapshot is of text positions here)
        if rc != 0:
            # the medium's rows decoded so far go too (the cache holds no medium there,
            # and a prompt with the same placeholders would keep them), with causal
            # attention back: a recurrent state decodes the rows it keeps again
            self._truncate(span.start)
            raise BackendError(f"llama_decode failed with code {rc} on "
                               f"{self.model.path.name} reading a medium")  # fmt: skip
        self._media = {**self._media, span.start: span}

    def checkpoint(self) -> None:
        """Keep a :class:`Checkpoint` of the recurrent state at ``n_past`` (one there
        replaced; beyond ``n_checkpoints``, the one whose going leaves the shortest gap
        dropped); nothing without them.

        Raises:
            BackendError: llama.cpp could not copy the state.
        """
        if not self.n_checkpoints or self.n_past == 0:
            return
        data = self._get_state(partial=True)
        kept = sorted([*(c for c in self._checkpoints if c.n != self.n_past),
                       Checkpoint(self.n_past, data)], key=lambda c: c.n)  # fmt: skip
        while len(kept) > self.n_checkpoints:
            # thinned where they are densest: the one whose going leaves the shortest gap
            # (the later on a tie; never the deepest), so that a long prompt's stay spread
            # over all of it rather than only its end
            gaps = [(kept[i + 1].n - (kept[i - 1].n if i else 0), -i)
                    for i in range(len(kept) - 1)]  # fmt: skip
            del kept[-min(gaps)[1]]
        self._checkpoints = kept

    @property
    def checkpoints(self) -> tuple[Checkpoint, ...]:
        """The recurrent state's checkpoints, by position."""
        return tuple(self._checkpoints)

    def save_state(self) -> SequenceState:
        """A copy of everything the sequence holds (llama.cpp's
        ``llama_state_seq_get_data``: its KV cells and recurrent state; its tokens, its
        checkpoints), for :meth:`load_state` on this context or one made alike.

        Raises:
            BackendError: llama.cpp could not copy the state.
        """
        if self._tree is not None:
            self._drop_tree(self._tree[1])
        data = self._get_state(partial=False) if self.n_past else b""
        return SequenceState(self._held[: self.n_past].copy(), data, tuple(self._checkpoints),
                             self._exact_to, tuple(self._media.values()))  # fmt: skip

    def load_state(self, state: SequenceState) -> None:
        """Replace what the sequence holds by ``state`` (from :meth:`save_state`).

        Raises:
            ContextOverflowError: the state holds more positions than ``n_ctx``.
            BackendError: llama.cpp refused the data (the sequence is then empty).
        """
        n = len(state.tokens)
        if n > self.n_ctx:
            raise ContextOverflowError(n, self.n_ctx, prompt=False, model=self.model.path.name)
        if self._tree is not None:
            self._drop_tree(self._tree[1])
        t0 = time.perf_counter()
        try:
            self._lc.llama_memory_seq_rm(self._mem, self._home, -1, -1)
            self.n_past = 0
            self._room = 0
            self._step_at, self._pending = -1, 0
            self._hidden_rows = []
            self._checkpoints = []
            self._exact_to = 0
            self._media = {}
            if n and not self._set_state(state.data, partial=False):
                self._lc.llama_memory_seq_rm(self._mem, self._home, -1, -1)
                raise BackendError(f"llama.cpp could not load a saved state of "
                                   f"{n} positions into {self.model.path.name}")  # fmt: skip
            self._held[:n] = state.tokens
            self.n_past = n
            self._checkpoints = list(state.checkpoints)
            self._exact_to = min(state.exact, n)
            self._media = {m.start: m for m in state.media if m.end <= n}
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def state_bytes(self) -> int:
        """What :meth:`save_state` would copy of llama.cpp's state, in bytes (0: empty)."""
        if not self.n_past:
            return 0
        # (rows kept for the next batch are not in it yet: a few cells less)
        return int(self._lc.llama_state_seq_get_size_ext(self._ctx, self._home, 0))

    def _get_state(self, *, partial: bool) -> bytes:
        self._flush()
        flags = _STATE_PARTIAL if partial else 0
        lc, ctx = self._lc, self._ctx
        size = lc.llama_state_seq_get_size_ext(ctx, self._home, flags)
        buf = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data_ext(ctx, buf, size, self._home, flags)
        if written == 0 and size:
            raise BackendError(f"llama.cpp could not copy the state of {self.model.path.name}")
        return ctypes.string_at(buf, written)

    def _set_state(self, data: bytes, *, partial: bool) -> bool:
        flags = _STATE_PARTIAL if partial else 0
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        return bool(self._lc.llama_state_seq_set_data_ext(self._ctx, buf, len(data),
                                                          self._home, flags))  # fmt: skip

    def hidden_rows(self, start: int, end: int) -> npt.NDArray[np.float32]:
        """The hidden states after positions ``start .. end - 1`` (``hidden`` contexts),
        float32[end - start, n_hidden], a copy.

        Raises:
            ValueError: not a ``hidden`` context, or a position not decoded (or forgotten,
                :meth:`forget_hidden`), or past ``n_past``.
        """
        if not self._hidden:
            raise ValueError("this context was created without hidden states")
        out = np.empty((max(0, end - start), self.n_hidden), np.float32)
        filled = np.zeros(len(out), bool)
        for p, h in self._hidden_rows:
            lo, hi = max(p, start), min(p + len(h), end)
            if lo < hi:
                out[lo - start : hi - start] = h[lo - p : hi - p]
                filled[lo - start : hi - start] = True
        if end > self.n_past or not filled.all():
            raise ValueError(f"no hidden states for positions {start}..{end - 1}")
        return out

    def forget_hidden(self, before: int) -> None:
        """Forget the hidden states of the positions before ``before`` (read for good)."""
        self._hidden_rows = [
            (p, h) if p >= before else (before, h[before - p :].copy())
            for p, h in self._hidden_rows if p + len(h) > before
        ]  # fmt: skip

    @contextlib.contextmanager
    def scratch(self) -> Iterator[None]:
        """Evaluations inside go to a copy of sequence 0 (``scratch`` contexts), dropped
        whole at the end: ``n_past`` is then as before. A recurrent state is copied by
        llama.cpp at the copy's first decode (``seq_cp``); a KV cache's cells are shared.

        Raises:
            ValueError: not a ``scratch`` context.
        """
        if not self._scratch_ok:
            raise ValueError("this context was created without a scratch sequence")
        self._flush()
        lc, n_past, hidden = self._lc, self.n_past, self._hidden
        lc.llama_memory_seq_cp(self._mem, 0, 1, -1, -1)
        self._set_seq(1)
        self._hidden = False
        try:
            yield
        finally:
            lc.llama_memory_seq_rm(self._mem, 1, -1, -1)
            self._set_seq(0)
            self._hidden = hidden
            self.n_past = n_past
            self._room = 0

    @property
    def base(self) -> LlamaContext:
        """The context this is a sequence of (:meth:`sequence`): itself for sequence 0."""
        return self

    def sequence(self, i: int) -> LlamaContext:
        """Sequence ``i`` of a parallel context (``n_parallel``): 0 is this context, the
        others views of it with their own ``n_past``, cache positions, rollback and
        ``eval_seconds`` (a decode shared by several sequences counts its whole time in
        each). A view lives as long as this context and is never closed itself.

        Raises:
            ValueError: no such sequence.
        """
        if not 0 <= i < self.n_parallel:
            raise ValueError(f"sequence {i} of a context of {self.n_parallel}")
        if i == 0:
            return self
        view = _Sequence.__new__(_Sequence)
        view.__dict__.update(self.__dict__)
        view._base = self
        view._seq = view._home = i
        view.n_past = 0
        view.eval_seconds = 0.0
        view._room = 0
        view._step_at, view._step_buf, view._step_len, view._pending = -1, None, 0, 0
        view._step_joined = False
        view._held = np.zeros_like(self._held)
        view._hidden_rows = []
        view._tree = None
        view._rows_per_decode = None
        view._checkpoints = []
        view._exact_to = 0
        view._media = {}  # (its media batch is this context's: see _read_media)
        return view

    def decode_many(
        self, parts: Sequence[tuple[LlamaContext, Sequence[int], Literal["all", "last", "none"]]]
    ) -> list[npt.NDArray[np.float32]]:
        """Decode several sequences' tokens in one ``llama_decode``: for each part, a
        sequence of this context (:meth:`sequence`), its tokens (appended at its
        ``n_past``) and the logits it wants back ("all" its rows, "last" its last row,
        "none"). Sequences are batched as llama-server batches its slots
        (tools/server/server-context.cpp); each row attends to its own sequence's cells.

        Returns:
            for each part, a read-only float32[n_out, n_vocab] array of its logits (a
            view of llama.cpp's output buffer, valid until the next decode).

        Raises:
            ValueError: more rows than ``n_batch``, more logits than ``n_outputs_max``, a
                sequence twice, or one of another context.
            ContextOverflowError: a sequence's tokens do not fit its context.
            BackendError: llama_decode failed (each sequence's cache is left as before).
        """
        rows = sum(len(t) for _, t, _ in parts)
        outs = [len(t) if w == "all" else int(w == "last" and bool(t)) for _, t, w in parts]
        if rows > self.n_batch or sum(outs) > self.n_outputs_max:
            raise ValueError(f"{rows} rows and {sum(outs)} outputs: at most n_batch="
                             f"{self.n_batch} and n_outputs_max={self.n_outputs_max}")  # fmt: skip
        seqs = [ctx for ctx, _, _ in parts]
        if len({id(c) for c in seqs}) < len(seqs) or any(c.base is not self for c in seqs):
            raise ValueError("each part must be a different sequence of this context")
        for ctx in seqs:  # (a replayed sequence's kept rows, decoded alone first)
            ctx._flush()
        for ctx, tokens, _ in parts:
            if ctx.n_past + len(tokens) > ctx.n_ctx:
                raise ContextOverflowError(
                    ctx.n_past + len(tokens), ctx.n_ctx, prompt=False, model=self.model.path.name
                )
        b, seq_id, row = self._batch, self._batch.seq_id, 0
        # the batch's columns as lists, each copied in once (per part, numpy's slicing and
        # a positions array cost more than the decode of a fast target's row)
        toks: list[int] = []
        pos: list[int] = []
        flags: list[int] = []
        for (ctx, tokens, want), n_out in zip(parts, outs, strict=True):
            m = len(tokens)
            toks.extend(tokens)  # (not +=: with an array of tokens numpy would add them)
            p = ctx.n_past - ctx._shift
            pos.extend(range(p, p + m))
            flags.extend([int(want == "all")] * m)
            if n_out and want == "last":
                flags[-1] = 1
            home = ctx._home
            for i in range(row, row + m):
                seq_id[i][0] = home
            row += m
        self._tok[:rows] = toks
        self._pos[:rows] = pos
        self._out[:rows] = flags
        b.n_tokens = rows
        t0 = time.perf_counter()
        try:
            rc = self._lc.llama_decode(self._ctx, b) if rows else 0
            if rc != 0:
                for ctx in seqs:
                    ctx._truncate(ctx.n_past, reread=ctx.recurrent)
                raise BackendError(f"llama_decode failed with code {rc} on "
                                   f"{self.model.path.name} ({rows} tokens of {len(parts)} "
                                   "sequences)")  # fmt: skip
        finally:
            seconds = time.perf_counter() - t0
            for ctx in seqs:
                ctx.eval_seconds += seconds
        # llama.cpp puts the hidden states of every row back in the batch's order
        # (llama_context::output_reorder), whatever micro-batches it split the batch into
        hidden = self._read_hidden(rows) if self._hidden and rows else None
        result, first, row = [], 0, 0
        for (ctx, tokens, _), n_out in zip(parts, outs, strict=True):
            m = len(tokens)
            if hidden is not None and m:
                ctx._hidden_rows.append((ctx.n_past, hidden[row : row + m].copy()))
            row += m
            if m == 1:
                ctx._held[ctx.n_past] = tokens[0]
            else:
                ctx._held[ctx.n_past : ctx.n_past + m] = tokens
            ctx.n_past += m
            ctx._step_at = -1
            ctx._room = min(ctx.n_rs_seq, m - 1) if m else 0
            result.append(self._logits(first, n_out))
            first += n_out
        return result

    def _set_seq(self, seq: int) -> None:
        for i in range(self.n_batch):
            self._batch.seq_id[i][0] = seq
        self._seq = seq

    def _is_open(self) -> bool:
        return self._ctx is not None

    def _free(self) -> None:
        """Free the batch and the context (its KV cache)."""
        if self._batch is not None:
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        if self._media_batch is not None:
            self._lc.llama_batch_free(self._media_batch)
            self._media_batch = None
        if self._ctx is not None:
            self._lc.llama_free(self._ctx)
            self._ctx = None


class _Sequence(LlamaContext):
    """A sequence of a parallel :class:`LlamaContext` (:meth:`LlamaContext.sequence`):
    its own positions over the shared context, which it never frees."""

    _base: LlamaContext

    @property
    def base(self) -> LlamaContext:
        return self._base

    def _is_open(self) -> bool:
        return self._base._is_open()

    def _free(self) -> None:
        pass


class DraftHead(_Native):
    """A context that drafts from the target's hidden states (:class:`MtpHead`,
    :class:`Eagle3Head`): ``encode`` maps the target's hidden states (float32[m, n_embd])
    to the rows ``eval`` reads; ``eval`` rows of (token, input row) at the next of its
    ``n_past`` positions of the text, of which its KV cache holds all but the first
    ``_offset``; ``rollback`` cuts its cache; ``save_state`` / ``load_state`` copy it out
    and back."""

    n_ctx: int
    n_vocab: int
    n_embd: int
    n_past: int
    model: LlamaModel
    _lc: Any
    _ctx: Any
    _mem: Any
    _batch: Any
    #: text positions before the first the KV cache holds (an EAGLE-3 head's row 0)
    _offset = 0
    #: MTP blocks that draft in turn (:meth:`MtpHead.chain`; 1: one drafts every token)
    n_heads = 1

    def chain(
        self, block: int, tokens: Sequence[int], inputs: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Draft with block ``block`` of several (:meth:`MtpHead.chain`).

        Raises:
            ValueError: always: this head has one block.
        """
        raise ValueError(f"{self.model.path.name}: one block drafts every token")

    def _open(self, model: LlamaModel, target: LlamaContext, what: str, **params: Any) -> None:
        """Create the head's context for ``model`` beside ``target`` (its ``ctx_other``:
        the target's embeddings, LM head or cache where the head reads them), as large as
        the target's sequence, one sequence, the target's threads, with llama.cpp's
        context ``params`` given (n_ubatch, n_outputs_max, ...), and its own hidden state
        kept for the rows it outputs (``llama_set_embeddings_nextn``). Sets the context,
        its memory, ``model``, ``n_ctx`` and ``n_batch``.

        Raises:
            BackendError: llama.cpp could not create it (``what``: the context, in words).
        """
        from llama_cpp import llama_cpp_ext

        lc = self._lc
        cp = lc.llama_context_default_params()
        cp.ctx_other = target._ctx
        cp.n_ctx = target.n_ctx_allocated
        cp.n_batch = target.n_batch
        cp.n_seq_max = 1
        cp.n_threads = cp.n_threads_batch = lc.llama_n_threads(target._ctx)
        cp.no_perf = True
        for name, value in params.items():
            setattr(cp, name, value)
        ctx = lc.llama_init_from_model(model.handle, cp)
        if not ctx:
            raise BackendError(f"llama.cpp could not create {what} for {model.path.name}")
        self._ctx = ctx
        llama_cpp_ext.llama_set_embeddings_nextn(ctx, True, True)
        self._mem = lc.llama_get_memory(ctx)
        self.n_ctx = target.n_ctx
        self.n_batch = target.n_batch

    def _last_output(self, width: int) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """The logits after the latest decode's last output row (float32[n_vocab],
        read-only view of llama.cpp's buffer until the next decode) and the head's hidden
        state there (float32[width], a copy)."""
        from llama_cpp import llama_cpp_ext

        logits = np.ctypeslib.as_array(
            self._lc.llama_get_logits_ith(self._ctx, -1), shape=(self.n_vocab,)
        )
        logits.flags.writeable = False
        h = np.ctypeslib.as_array(
            llama_cpp_ext.llama_get_embeddings_nextn_ith(self._ctx, -1), shape=(width,)
        ).copy()
        return logits, h

    def _init_batch(self, n_batch: int, width: int) -> None:
        """A batch of token ids and input rows of ``width`` values together:
        llama_batch_init allocates either, so the token array is ours (and detached again
        before the batch is freed, :meth:`_free`)."""
        self._batch = b = self._lc.llama_batch_init(n_batch, width, 1)
        self._tokens = (ctypes.c_int32 * n_batch)()
        b.token = self._tokens
        self._tok = np.ctypeslib.as_array(self._tokens, shape=(n_batch,))
        self._emb = np.ctypeslib.as_array(b.embd, shape=(n_batch, width))
        self._pos = np.ctypeslib.as_array(b.pos, shape=(n_batch,))
        self._out = np.ctypeslib.as_array(b.logits, shape=(n_batch,))
        np.ctypeslib.as_array(b.n_seq_id, shape=(n_batch,))[:] = 1
        for i in range(n_batch):
            b.seq_id[i][0] = 0

    def encode(self, inputs: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        raise NotImplementedError

    def eval(
        self, tokens: Sequence[int], inputs: npt.NDArray[np.float32], *, last: bool
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        raise NotImplementedError

    def token_seconds(self, repeats: int = 5) -> float:
        """Seconds per draft token: the least of ``repeats`` one-row evaluations at
        position 1 (the draft time of auto mode's cost model, as a draft model's). The
        head's cache is empty afterwards."""
        zeros = self.encode(np.zeros((2, self.n_embd), np.float32))
        best = math.inf
        self.rollback(0)
        self.eval([0], zeros[:1], last=False)  # (an EAGLE-3 head has no row at 0)
        for _ in range(repeats):
            self.rollback(1)
            t0 = time.perf_counter()
            self.eval([0], zeros[1:], last=True)
            best = min(best, time.perf_counter() - t0)
        self.rollback(0)
        return best

    def save_state(self) -> bytes:
        """A copy of the head's KV cache (llama.cpp's sequence state), for
        :meth:`load_state`.

        Raises:
            BackendError: llama.cpp could not copy it.
        """
        lc = self._lc
        size = lc.llama_state_seq_get_size_ext(self._ctx, 0, 0)
        buf = (ctypes.c_uint8 * size)()
        written = lc.llama_state_seq_get_data_ext(self._ctx, buf, size, 0, 0)
        if written == 0 and size:
            raise BackendError(f"llama.cpp could not copy the state of {self.model.path.name}")
        return ctypes.string_at(buf, written)

    def load_state(self, data: bytes, n_past: int) -> None:
        """Make the head's cache hold ``data`` (from :meth:`save_state`), of ``n_past``
        positions of the text.

        Raises:
            BackendError: llama.cpp refused it (the cache is then empty).
        """
        lc = self._lc
        lc.llama_memory_seq_rm(self._mem, 0, -1, -1)
        self.n_past = 0
        if n_past <= self._offset:
            self.n_past = n_past
            return
        buf = (ctypes.c_uint8 * len(data)).from_buffer_copy(data)
        if not lc.llama_state_seq_set_data_ext(self._ctx, buf, len(data), 0, 0):
            lc.llama_memory_seq_rm(self._mem, 0, -1, -1)
            raise BackendError(f"llama.cpp could not load a saved state into "
                               f"{self.model.path.name}")  # fmt: skip
        self.n_past = n_past

    def rollback(self, n_keep: int) -> None:
        """Keep the text's first ``n_keep`` positions (the head's layers are attention:
        any position can be cut).

        Raises:
            ValueError: ``n_keep`` is negative or beyond ``n_past``.
        """
        if not 0 <= n_keep <= self.n_past:
            raise ValueError(f"cannot roll back to {n_keep} with {self.n_past} positions")
        if n_keep < self.n_past:
            self._lc.llama_memory_seq_rm(self._mem, 0, max(0, n_keep - self._offset), -1)
            self.n_past = n_keep

    def _is_open(self) -> bool:
        return self._ctx is not None

    def _free(self) -> None:
        if self._batch is not None:
            self._batch.token = ctypes.POINTER(ctypes.c_int32)()
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx is not None:
            self._lc.llama_free(self._ctx)
            self._ctx = None


class MtpHead(DraftHead):
    """The target's own multi-token-prediction layers (``{arch}.nextn_predict_layers``),
    run in a context of their own (``LLAMA_CONTEXT_TYPE_MTP``) with a KV cache for those
    layers alone, as llama.cpp's ``draft-mtp`` does (common/speculative.cpp).

    A row of the head reads a token at position p with the target's hidden state after
    position p - 1 and predicts the token at p + 1; chained over its own hidden state, one
    layer drafts several tokens (:class:`specgguf.speculative.drafters.MtpDrafter`).

    A model with several MTP blocks (Hunyuan V3, MiMo-V2, Step-3.5: ``n_heads``) has them
    draft in turn, as llama.cpp does (``llama_set_nextn_layer_offset``): every block reads
    the committed text into its own layer's cache (:meth:`eval`), block 0 drafts the first
    token and block j the (j + 1)-th, reading the whole draft so far again (:meth:`chain`).

    Args:
        target: the target's context, created with ``hidden=True`` on a model loaded with
            ``load_mtp=True``.

    Raises:
        BackendError: the model has no MTP layers loaded, or llama.cpp could not create
            the context.
    """

    def __init__(self, target: LlamaContext) -> None:
        self._lc = lc = target._lc
        self.model = model = target.model
        self._ctx: Any = None
        self._batch: Any = None
        if not model.n_layer_nextn:
            raise BackendError(f"{model.path.name} has no multi-token-prediction layers loaded")
        self._open(model, target, "an MTP context", ctx_type=lc.LLAMA_CONTEXT_TYPE_MTP,
                   n_ubatch=min(target.n_batch, 128), n_outputs_max=1)  # fmt: skip
        self.n_vocab: int = model.n_vocab
        self.n_embd: int = target.n_embd_out
        self.n_heads = model.n_layer_nextn
        #: the most tokens a draft has (several blocks: one each; 0: no bound)
        self.max_draft = self.n_heads if self.n_heads > 1 else 0
        self.n_past = 0
        self.eval_seconds = 0.0
        self._init_batch(self.n_batch, self.n_embd)
        model._contexts.add(self)  # type: ignore[arg-type]

    def encode(self, inputs: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The rows :meth:`eval` reads for the target's hidden states ``inputs``: the
        hidden states themselves."""
        return inputs

    def eval(
        self, tokens: Sequence[int], inputs: npt.NDArray[np.float32], *, last: bool
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        """Decode ``tokens`` at positions ``n_past ...``, row i with ``inputs[i]`` (the
        hidden state after the position before it, float32[len(tokens), n_embd]); with
        ``last``, return the logits after the last token (float32[n_vocab], read-only
        view) and the head's hidden state there (float32[n_embd], a copy), else None.
        With several blocks, each reads the rows but the one whose output is returned,
        which block 0 reads (common/speculative.cpp: ``process`` and the first step of
        ``draft``).

        Raises:
            ContextOverflowError: past the context.
            BackendError: llama_decode failed.
        """
        n = len(tokens)
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(self.n_past + n, self.n_ctx, prompt=False,
                                       model=self.model.path.name)  # fmt: skip
        if last and n > 1:
            # The hidden state llama.cpp returns is the batch's first row's, not the
            # output row's (qwen35's MTP graph sets it before selecting the outputs), so
            # the row that is read goes alone, as llama.cpp's draft-mtp decodes it.
            self.eval(tokens[:-1], inputs[:-1], last=False)
            return self.eval(tokens[-1:], inputs[-1:], last=True)
        t0 = time.perf_counter()
        try:
            for start in range(0, n, self.n_batch):
                m = min(self.n_batch, n - start)
                self._tok[:m] = tokens[start : start + m]
                self._emb[:m] = inputs[start : start + m]
                self._pos[:m] = np.arange(self.n_past, self.n_past + m, dtype=np.int32)
                self._out[:m] = 0
                if last and start + m == n:
                    self._out[m - 1] = 1
                self._batch.n_tokens = m
                for block in range(1 if last else self.n_heads):
                    self._decode(block, m)
                self.n_past += m
            if not last:
                return None
            return self._last_output(self.n_embd)
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def token_seconds(self, repeats: int = 5) -> float:
        """Seconds per draft token (see :meth:`DraftHead.token_seconds`); with several
        blocks, those of a whole chained draft (block j reading j + 1 rows) over its
        tokens, the least of ``repeats``. The head's cache is empty afterwards."""
        n = self.n_heads
        if n == 1:
            return super().token_seconds(repeats)
        rows = np.zeros((n + 1, self.n_embd), np.float32)
        best = math.inf
        self.rollback(0)
        self.eval([0], rows[:1], last=False)
        for _ in range(repeats):
            self.rollback(1)
            t0 = time.perf_counter()
            self.eval([0], rows[1:2], last=True)
            for block in range(1, n):
                self.chain(block, [0] * (block + 1), rows[1 : block + 2])
            best = min(best, time.perf_counter() - t0)
        self.rollback(0)
        return best / n

    def _decode(self, block: int, m: int) -> None:
        """Decode the batch's ``m`` rows at ``n_past ...`` with MTP block ``block``. Each
        block's K/V go into cells of its own layer; a block after the first takes the
        cells again from ``n_past`` (llama.cpp's chained heads: the cells the previous
        block's decode freed are found first, so its layer's K/V stay in them).

        Raises:
            BackendError: llama_decode failed.
        """
        from llama_cpp import llama_cpp_ext

        lc = self._lc
        if self.n_heads > 1:
            lc.llama_memory_seq_rm(self._mem, 0, self.n_past, -1)
            llama_cpp_ext.llama_set_nextn_layer_offset(self._ctx, block)
        try:
            rc = lc.llama_decode(self._ctx, self._batch)
        finally:
            if self.n_heads > 1:  # (block 0 for every other decode, as llama.cpp leaves it)
                llama_cpp_ext.llama_set_nextn_layer_offset(self._ctx, 0)
        if rc != 0:
            lc.llama_memory_seq_rm(self._mem, 0, self.n_past, -1)
            raise BackendError(f"llama_decode failed with code {rc} on the MTP layers "
                               f"of {self.model.path.name}")  # fmt: skip

    def chain(
        self, block: int, tokens: Sequence[int], inputs: npt.NDArray[np.float32]
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]]:
        """Draft with MTP block ``block``: decode a draft's rows again from its first
        position (the last committed token's, ``n_past - len(tokens) + 1`` after the
        previous block's), ``tokens`` (the last committed token and the draft so far)
        with ``inputs`` (float32[len(tokens), n_embd]: the target's hidden state before
        the first, then the hidden state each block returned with the token it drafted);
        returns the logits after the last row (float32[n_vocab], read-only view) and the
        block's hidden state there (float32[n_embd], a copy). llama.cpp's ``draft`` in
        common/speculative.cpp, ``chain_heads``.

        Raises:
            ValueError: ``block`` is not one of the model's, or ``tokens`` does not follow
                the previous block's rows.
            ContextOverflowError: past the context.
            BackendError: llama_decode failed.
        """
        n = len(tokens)
        if not 0 < block < self.n_heads or n != block + 1:
            raise ValueError(f"block {block} of {self.n_heads} reads {block + 1} rows, not {n}")
        start = self.n_past - block  # (the previous block decoded n - 1 rows from there)
        if start + n > self.n_ctx:
            raise ContextOverflowError(start + n, self.n_ctx, prompt=False,
                                       model=self.model.path.name)  # fmt: skip
        t0 = time.perf_counter()
        try:
            self.n_past = start
            self._tok[:n] = tokens
            self._emb[:n] = inputs
            self._pos[:n] = np.arange(start, start + n, dtype=np.int32)
            self._out[:n] = 0
            self._out[n - 1] = 1
            self._batch.n_tokens = n
            self._decode(block, n)
            self.n_past = start + n
            return self._last_output(self.n_embd)
        finally:
            self.eval_seconds += time.perf_counter() - t0


class Eagle3Head(DraftHead):
    """An EAGLE-3 draft head (a GGUF of architecture ``eagle3``; Li et al. 2025, "EAGLE-3:
    Scaling up Inference Acceleration of Large Language Models via Training-Time Test"),
    run as llama.cpp's ``draft-eagle3`` runs it (common/speculative.cpp,
    ``common_speculative_impl_draft_eagle3``; src/models/eagle3.cpp): its encoder maps the
    inputs of three of the target's layers at a position P (``target_layers``) to g_P
    (:meth:`encode`), and its one decoder layer reads (token P + 1, g_P) at position P and
    gives the logits of the token after P + 1 and its own hidden state before the norm,
    which stands in for g at the next draft position.

    In :class:`specgguf.speculative.drafters.MtpDrafter`'s terms (a row for position p
    reads the token at p and a state of position p - 1), the pair (token p, g_(p-1)) is
    that row, kept at KV position p - 1: so :attr:`n_past` counts the text's positions,
    one more than the decoder's cache holds, and the row of position 0 (no state before
    it) is skipped. The decoder's logits are over the target's vocabulary (a head with a
    reduced vocabulary maps it by its ``d2t`` tensor, the rest at -inf), and it uses the
    target's token embeddings and LM head where it has none (``ctx_other``).

    Args:
        draft: the head's model (``eagle3``).
        target: the target's context (or a sequence of it), created with ``layer_inputs``
            the head's :attr:`target_layers`.

    Raises:
        BackendError: not an EAGLE-3 head of three layers, a target whose context keeps
            other hidden states, or llama.cpp could not create the context.
    """

    _offset = 1  # (the row of position 0 is skipped)

    def __init__(self, draft: LlamaModel, target: LlamaContext) -> None:
        from llama_cpp import llama_cpp_ext

        self._lc = lc = target._lc
        self._ext = llama_cpp_ext
        self.model = draft
        self._ctx: Any = None
        self._batch: Any = None
        self._enc_batch: Any = None
        layers = head_target_layers(draft)
        if len(layers) != 3 or target.layer_inputs != layers:
            raise BackendError(f"{draft.path.name} is not an EAGLE-3 head for the target's "
                               f"context (target layers {layers})")  # fmt: skip
        width = _meta_int(draft, "eagle3.target_hidden_size")
        if width != target.n_hidden // 3:
            raise BackendError(f"{draft.path.name} was made for a target {width} wide, and "
                               f"this one is {target.n_hidden // 3} wide")  # fmt: skip
        #: the target's layers whose inputs it reads
        self.target_layers = layers
        # (its encoder takes a batch in one micro-batch: encode() sends pieces of n_ubatch,
        # each an output, which sizes a logits buffer over the target's vocabulary)
        n_ubatch = min(target.n_batch, 32)
        self._open(draft, target, "a context", n_ubatch=n_ubatch, n_outputs_max=n_ubatch)
        self.n_ubatch: int = int(lc.llama_n_ubatch(self._ctx))
        self.n_vocab: int = target.n_vocab
        #: the width of the target's hidden states it reads (three layers' inputs)
        self.n_embd: int = target.n_hidden
        #: the decoder's width (g and its own hidden state)
        self.n_embd_dec: int = int(lc.llama_model_n_embd(draft.handle))
        self.n_past = 0
        self.eval_seconds = 0.0
        self._init_batch(self.n_batch, self.n_embd_dec)
        self._enc_batch = e = lc.llama_batch_init(self.n_ubatch, self.n_embd, 1)
        self._enc_emb = np.ctypeslib.as_array(e.embd, shape=(self.n_ubatch, self.n_embd))
        self._enc_pos = np.ctypeslib.as_array(e.pos, shape=(self.n_ubatch,))
        np.ctypeslib.as_array(e.n_seq_id, shape=(self.n_ubatch,))[:] = 1
        np.ctypeslib.as_array(e.logits, shape=(self.n_ubatch,))[:] = 1
        for i in range(self.n_ubatch):
            e.seq_id[i][0] = 0
        draft._contexts.add(self)  # type: ignore[arg-type]

    def encode(self, inputs: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """g for each row of the target's hidden states ``inputs``
        (float32[m, n_embd] -> float32[m, n_embd_dec]), by the head's encoder.

        Raises:
            BackendError: llama_encode failed.
        """
        m = len(inputs)
        out = np.empty((m, self.n_embd_dec), np.float32)
        t0 = time.perf_counter()
        try:
            for start in range(0, m, self.n_ubatch):
                n = min(self.n_ubatch, m - start)
                self._enc_emb[:n] = inputs[start : start + n]
                # (the encoder reads no positions, but llama.cpp checks them against the
                # cache's: placeholders after its last, as common/speculative.cpp does)
                first = int(self._lc.llama_memory_seq_pos_max(self._mem, 0)) + 1
                self._enc_pos[:n] = np.arange(first, first + n, dtype=np.int32)
                self._enc_batch.n_tokens = n
                if self._lc.llama_encode(self._ctx, self._enc_batch) != 0:
                    raise BackendError(f"llama_encode failed on {self.model.path.name}")
                g = np.ctypeslib.as_array(self._ext.llama_get_embeddings_nextn(self._ctx),
                                          shape=(n, self.n_embd_dec))  # fmt: skip
                out[start : start + n] = g
        finally:
            self.eval_seconds += time.perf_counter() - t0
        return out

    def eval(
        self, tokens: Sequence[int], inputs: npt.NDArray[np.float32], *, last: bool
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        """Decode the rows of ``tokens`` at the text's positions ``n_past ...``, row i
        with ``inputs[i]`` (g of the position before it, or the head's own hidden state
        there: float32[len(tokens), n_embd_dec]); with ``last``, return the logits after
        the last token (float32[n_vocab], read-only view) and the head's hidden state
        there (float32[n_embd_dec], a copy), else None (also where only position 0's row
        was given, which is skipped: see the class).

        Raises:
            ContextOverflowError: past the context.
            BackendError: llama_decode failed.
        """
        n = len(tokens)
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(self.n_past + n, self.n_ctx, prompt=False,
                                       model=self.model.path.name)  # fmt: skip
        skip = 1 if self.n_past == 0 and n else 0  # position 0: no pair
        self.n_past += skip
        tokens, inputs, n = tokens[skip:], inputs[skip:], n - skip
        if n == 0:
            return None
        t0 = time.perf_counter()
        try:
            for start in range(0, n, self.n_batch):
                m = min(self.n_batch, n - start)
                at = self.n_past - 1  # the decoder's cache position of this row
                self._tok[:m] = tokens[start : start + m]
                self._emb[:m] = inputs[start : start + m]
                self._pos[:m] = np.arange(at, at + m, dtype=np.int32)
                self._out[:m] = 0
                if last and start + m == n:
                    self._out[m - 1] = 1
                self._batch.n_tokens = m
                rc = self._lc.llama_decode(self._ctx, self._batch)
                if rc != 0:
                    self._lc.llama_memory_seq_rm(self._mem, 0, at, -1)
                    raise BackendError(f"llama_decode failed with code {rc} on "
                                       f"{self.model.path.name}")  # fmt: skip
                self.n_past += m
            if not last:
                return None
            return self._last_output(self.n_embd_dec)
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def _free(self) -> None:
        if self._enc_batch is not None:
            self._lc.llama_batch_free(self._enc_batch)
            self._enc_batch = None
        super()._free()


class DFlashHead(DraftHead):
    """A DFlash block-diffusion draft (a GGUF of architecture ``dflash``; Chen et al. 2026,
    "DFlash: Block Diffusion for Flash Speculative Decoding"), run as llama.cpp's
    ``draft-dflash`` runs it (common/speculative.cpp, ``common_speculative_impl_draft_dflash``;
    src/models/dflash.cpp).

    Its cache holds, at each position the target committed, K/V computed from the inputs
    of the target's layers there (``target_layers``: :meth:`eval` with those rows, fused
    by its ``fc``); a draft is one decode of a block [last token, mask, ..., mask] at the
    next positions with attention over the cache and the whole block (no causal mask, unless
    the GGUF says ``dflash.attention.causal``), whose rows after the first give the draft's
    logits all at once (:meth:`block`); the block leaves the cache again. It uses the
    target's token embeddings and LM head where it has none (``ctx_other``), and a reduced
    vocabulary maps onto the target's by ``d2t``.

    A DSpark draft (a DFlash file with a Markov head, llama.cpp's ``draft-dspark``) is run
    the same way: llama.cpp's graph adds to each block row's logits a bias from the row
    before's greedy token; unless ``dflash.sample_from_anchor`` is false, the block's row
    0 (the last token's) predicts too, so a draft of K is a block of K rows. With a
    confidence head it gives each row an estimate that the target accepts it
    (:meth:`confidence`). A DFlash2 draft (a selector, ``dflash.selector_top_k``) gives
    no logits but its selector's lattice: for each block row the ``selector_top_k`` best
    candidates' ids and their scores after each candidate of the row before
    (src/models/dflash.cpp, ``build_dflash2_selector``), which the drafter walks.

    Args:
        draft: the draft's model (``dflash``).
        target: the target's context (or a sequence of it), created with ``layer_inputs``
            the draft's :attr:`target_layers`.

    Raises:
        BackendError: not a DFlash draft for the target's context, no mask token, or
            llama.cpp could not create the context.
    """

    def __init__(self, draft: LlamaModel, target: LlamaContext) -> None:

        self._lc = lc = target._lc
        self.model = draft
        self._ctx: Any = None
        self._batch: Any = None
        self._blk: Any = None
        layers = head_target_layers(draft)
        width = int(lc.llama_model_n_embd(draft.handle))
        if not layers or target.layer_inputs != layers or width * len(layers) != target.n_hidden:
            raise BackendError(f"{draft.path.name} is not a DFlash draft for the target's "
                               f"context (target layers {layers}, {width} wide)")  # fmt: skip
        #: a DFlash2 draft's candidates per block row (0: not DFlash2)
        self.selector_top_k: int = _meta_int(draft, "dflash.selector_top_k")
        #: the target's layers whose inputs it reads
        self.target_layers = layers
        #: the block it was trained on
        self.block_size: int = _meta_int(draft, "dflash.block_size") or 16
        names = tensor_names(draft.path)
        #: a DSpark draft (a Markov head), and one with a confidence head
        self.markov = "markov_w1.weight" in names
        said = _meta_str(draft, "dflash.has_confidence_head")
        self.confidence_head = self.markov and "conf_proj.weight" in names and said != "false"
        # rows of a block before the first that predicts: DSpark's row 0 predicts unless
        # its file says otherwise (common/speculative.cpp reads the key only for DSpark)
        anchor = self.markov and _meta_str(draft, "dflash.sample_from_anchor") in ("", "true")
        self._lead = 0 if anchor else 1
        #: the most tokens a draft has
        self.max_draft: int = self.block_size - self._lead
        self._width = width
        self._rows = 0
        vocab = lc.llama_model_get_vocab(draft.handle)
        #: the token the block's rows after the first read
        self.mask_token: int = int(lc.llama_vocab_mask(vocab))
        if self.mask_token < 0:
            raise BackendError(
                f"{draft.path.name} has no mask token (tokenizer.ggml.mask_token_id)"
            )
        # Without a causal mask llama.cpp takes a decode in one micro-batch (it aborts
        # otherwise): a block always fits one, and eval() sends pieces of one.
        ubatch = max(min(target.n_batch, 512), self.block_size)
        self._open(draft, target, "a context", n_batch=max(target.n_batch, ubatch),
                   n_ubatch=ubatch, n_outputs_max=self.block_size)  # fmt: skip
        self._piece = int(lc.llama_n_ubatch(self._ctx))
        causal = _meta_str(draft, "dflash.attention.causal") == "true"
        lc.llama_set_causal_attn(self._ctx, causal)
        if self.selector_top_k:
            from llama_cpp import llama_cpp_ext

            # (every row's lattice, as common/speculative.cpp asks for DFlash2)
            llama_cpp_ext.llama_set_embeddings_nextn(self._ctx, True, False)
        self.n_vocab: int = draft.n_vocab
        #: the width of the target's rows it reads (its layers' inputs side by side)
        self.n_embd: int = target.n_hidden
        self.n_past = 0
        self.eval_seconds = 0.0
        # (two batches: llama.cpp reads a batch's tokens or its rows, not both)
        self._batch = b = lc.llama_batch_init(self.n_batch, self.n_embd, 1)
        self._emb = np.ctypeslib.as_array(b.embd, shape=(self.n_batch, self.n_embd))
        # A draft for an M-RoPE target reads 4 positions per row of target rows, section by
        # section (pos[j * n_rows + i]: {p, p, p, 0}, as common/speculative.cpp gives them):
        # our own array, detached again before the batch is freed
        self._n_pos = 4 if lc.llama_model_rope_type(draft.handle) == lc.LLAMA_ROPE_TYPE_MROPE else 1
        self._positions = (ctypes.c_int32 * (self._n_pos * self.n_batch))()
        # (its address: a pointer field read back is a view of the struct)
        self._own_pos: int = ctypes.cast(b.pos, ctypes.c_void_p).value or 0
        b.pos = self._positions
        self._pos = np.ctypeslib.as_array(self._positions, shape=(self._n_pos * self.n_batch,))
        np.ctypeslib.as_array(b.logits, shape=(self.n_batch,))[:] = 0
        self._blk = k = lc.llama_batch_init(self.block_size, 0, 1)
        self._blk_tok = np.ctypeslib.as_array(k.token, shape=(self.block_size,))
        self._blk_pos = np.ctypeslib.as_array(k.pos, shape=(self.block_size,))
        # (every row an output: the graph selects none, so llama.cpp's rows are the
        # batch's first n_outputs; DFlash2's rows are its lattice's, no logits)
        np.ctypeslib.as_array(k.logits, shape=(self.block_size,))[:] = not self.selector_top_k
        for batch, n in ((b, self.n_batch), (k, self.block_size)):
            np.ctypeslib.as_array(batch.n_seq_id, shape=(n,))[:] = 1
            for i in range(n):
                batch.seq_id[i][0] = 0
        draft._contexts.add(self)  # type: ignore[arg-type]

    def encode(self, inputs: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The rows :meth:`eval` reads: the target's layer inputs themselves (its ``fc``
        runs inside llama.cpp's decode)."""
        return inputs

    def eval(
        self, tokens: Sequence[int], inputs: npt.NDArray[np.float32], *, last: bool
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        """Write the K/V of the target's rows ``inputs`` (float32[len(tokens), n_embd], the
        target's layer inputs at the positions of ``tokens``) at positions ``n_past ...``;
        returns None (``last`` is refused: a DFlash draft gives logits only for a block,
        :meth:`block`).

        Raises:
            ValueError: ``last``.
            ContextOverflowError: past the context.
            BackendError: llama_decode failed.
        """
        if last:
            raise ValueError("a DFlash draft gives logits for a block only")
        n = len(tokens)
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(self.n_past + n, self.n_ctx, prompt=False,
                                       model=self.model.path.name)  # fmt: skip
        t0 = time.perf_counter()
        try:
            piece = min(self.n_batch, self._piece)
            for start in range(0, n, piece):
                m = min(piece, n - start)
                self._emb[:m] = inputs[start : start + m]
                pos = np.arange(self.n_past, self.n_past + m, dtype=np.int32)
                for j in range(self._n_pos):
                    self._pos[j * m : (j + 1) * m] = pos if j < 3 else 0
                self._batch.n_tokens = m
                rc = self._lc.llama_decode(self._ctx, self._batch)
                if rc != 0:
                    self._lc.llama_memory_seq_rm(self._mem, 0, self.n_past, -1)
                    raise BackendError(f"llama_decode failed with code {rc} on "
                                       f"{self.model.path.name}")  # fmt: skip
                self.n_past += m
        finally:
            self._rows = 0
            self.eval_seconds += time.perf_counter() - t0
        return None

    def block(self, first: int, n: int) -> npt.NDArray[np.float32]:
        """The logits of ``n`` draft tokens after the last committed token ``first``
        (float32[n, n_vocab]; a DFlash2 draft's lattice rows, float32[n, its width]; a
        read-only view of llama.cpp's buffer until the next decode): one decode of
        [first, mask x (n - 1)] (DSpark's row 0 predicts) or [first, mask x n] at positions
        ``n_past ...``, which leave the cache again (``n_past`` is unchanged).

        Raises:
            ValueError: ``n`` is not in 1 .. max_draft.
            ContextOverflowError: past the context.
            BackendError: llama_decode failed.
        """
        if not 0 < n <= self.max_draft:
            raise ValueError(f"a block of {self.block_size} drafts 1 to {self.max_draft} "
                             f"tokens, not {n}")  # fmt: skip
        rows = n + self._lead
        if self.n_past + rows > self.n_ctx:
            raise ContextOverflowError(self.n_past + rows, self.n_ctx, prompt=False,
                                       model=self.model.path.name)  # fmt: skip
        t0 = time.perf_counter()
        try:
            self._blk_tok[0] = first
            self._blk_tok[1:rows] = self.mask_token
            self._blk_pos[:rows] = np.arange(self.n_past, self.n_past + rows, dtype=np.int32)
            self._blk.n_tokens = rows
            self._rows = 0
            rc = self._lc.llama_decode(self._ctx, self._blk)
            self._lc.llama_memory_seq_rm(self._mem, 0, self.n_past, -1)
            if rc != 0:
                raise BackendError(f"llama_decode failed with code {rc} on "
                                   f"{self.model.path.name}")  # fmt: skip
            self._rows = rows
            if self.selector_top_k:
                from llama_cpp import llama_cpp_ext

                out = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn(self._ctx),
                                            shape=(rows, self._width))[self._lead :]  # fmt: skip
            else:
                out = np.ctypeslib.as_array(self._lc.llama_get_logits(self._ctx),
                                            shape=(rows, self.n_vocab))[self._lead :]  # fmt: skip
            out.flags.writeable = False
            return out
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def confidence(self) -> npt.NDArray[np.float32]:
        """A DSpark draft's confidence head's estimate, for each token of the latest
        :meth:`block`, that the target accepts it (float32[n], a copy; in [0, 1], a
        sigmoid: src/models/dflash.cpp, ``build_dspark_markov_head``).

        Raises:
            ValueError: the draft has no confidence head, or no block was decoded since
                the latest :meth:`eval`.
        """
        from llama_cpp import llama_cpp_ext

        if not self.confidence_head or not self._rows:
            raise ValueError(f"{self.model.path.name}: no confidence head, or no block")
        # (llama.cpp broadcasts each row's one value over a row of the draft's width)
        rows = np.ctypeslib.as_array(llama_cpp_ext.llama_get_embeddings_nextn(self._ctx),
                                     shape=(self._rows, self._width))  # fmt: skip
        return rows[self._lead :, 0].copy()

    def token_seconds(self, repeats: int = 5) -> float:
        """Seconds per draft token of a draft of 4 (or the longest draft, if shorter):
        the least of ``repeats`` blocks at position 1, over its tokens. A block costs one
        decode whatever it drafts, so the cost model's time per token is right at that
        length, pessimistic for longer drafts and optimistic for shorter ones (each draft
        then reports its own). The cache is empty afterwards."""
        k = min(4, self.max_draft)
        self.rollback(0)
        self.eval([0], np.zeros((1, self.n_embd), np.float32), last=False)
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            self.block(0, k)
            best = min(best, time.perf_counter() - t0)
        self.rollback(0)
        return best / k

    def _free(self) -> None:
        if self._blk is not None:
            self._lc.llama_batch_free(self._blk)
            self._blk = None
        if self._batch is not None:
            self._batch.pos = ctypes.cast(self._own_pos, ctypes.POINTER(ctypes.c_int32))
            self._lc.llama_batch_free(self._batch)
            self._batch = None
        super()._free()


class AssistantHead(DraftHead):
    """Gemma 4's multi-token-prediction assistant (a GGUF of architecture
    ``gemma4-assistant``), run as llama.cpp's ``draft-mtp`` runs a separate MTP model
    (common/speculative.cpp, ``common_speculative_impl_draft_mtp`` with ``is_mem_shared``;
    src/models/gemma4-assistant.cpp): a few blocks without K or V of their own, whose
    queries attend over the target's KV cache (its last sliding-window and last full
    layer's, through ``ctx_other``).

    A row reads a token and a hidden state (the target's after the position before it,
    or the assistant's own from the row before, projected back to the target's width) and
    gives the logits of the next token. It holds nothing of the text: every draft row of
    a step sits at the step's first draft position (the target's cache holds the text
    before it), so :meth:`eval` decodes only the last row it is given, and rows that the
    text has committed only count (:attr:`n_past` follows the text as the MTP layers'
    does). The assistant's decodes leave cells at that position in the target's sequence,
    which :meth:`rollback` removes.

    Args:
        draft: the assistant's model.
        target: the target's context (or a sequence of it), created with ``hidden=True``.

    Raises:
        BackendError: not an assistant for the target's context (its
            ``embedding_length_out`` is the target's width), or llama.cpp could not create
            the context.
    """

    def __init__(self, draft: LlamaModel, target: LlamaContext) -> None:
        self._lc = lc = target._lc
        self.model = draft
        self._ctx: Any = None
        self._batch: Any = None
        width = _meta_int(draft, "gemma4-assistant.embedding_length_out")
        if width != target.n_embd_out or not target._hidden or target.layer_inputs:
            raise BackendError(f"{draft.path.name} is not an MTP assistant for the target's "
                               f"context (made for a target {width} wide)")  # fmt: skip
        self._target = target
        self._seq = target._home  # (its sequence of the target's cache)
        # (its cache is the target's: laid out alike)
        n_seq = lc.llama_n_seq_max(target._ctx)
        self._open(draft, target, "a context", n_ctx=lc.llama_n_ctx(target._ctx),
                   n_seq_max=n_seq, kv_unified=target.kv_unified,
                   type_k=KV_CACHE_TYPES[target.type_k], n_batch=8, n_ubatch=8,
                   n_outputs_max=max(1, n_seq))  # fmt: skip
        self.n_vocab: int = draft.n_vocab
        #: the width of the hidden states it reads and gives (the target's)
        self.n_embd: int = target.n_embd_out
        self.n_past = 0
        self.eval_seconds = 0.0
        self._anchor: int | None = None  # the position its rows sit at, since a rollback
        self._init_batch(1, self.n_embd)
        self._batch.seq_id[0][0] = self._seq  # type: ignore[attr-defined]
        draft._contexts.add(self)  # type: ignore[arg-type]

    def encode(self, inputs: npt.NDArray[np.float32]) -> npt.NDArray[np.float32]:
        """The rows :meth:`eval` reads: the target's hidden states themselves."""
        return inputs

    def eval(
        self, tokens: Sequence[int], inputs: npt.NDArray[np.float32], *, last: bool
    ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.float32]] | None:
        """Count ``tokens`` as the text's next positions; with ``last``, decode the last
        one with the last row of ``inputs`` (float32[len(tokens), n_embd]) at the step's
        draft position and return the logits after it (float32[n_vocab], read-only view)
        and the assistant's hidden state there (float32[n_embd], a copy), else None.

        Raises:
            ContextOverflowError: past the context.
            BackendError: llama_decode failed.
        """
        n = len(tokens)
        if self.n_past + n > self.n_ctx:
            raise ContextOverflowError(self.n_past + n, self.n_ctx, prompt=False,
                                       model=self.model.path.name)  # fmt: skip
        if not last or n == 0:
            self.n_past += n
            return None
        self.n_past += n - 1
        if self._anchor is None:
            self._anchor = self.n_past
        t0 = time.perf_counter()
        try:
            self._tok[0] = tokens[-1]
            self._emb[0] = inputs[-1]
            self._pos[0] = self._anchor
            self._out[0] = 1
            self._batch.n_tokens = 1
            rc = self._lc.llama_decode(self._ctx, self._batch)
            if rc != 0:
                self._lc.llama_memory_seq_rm(self._mem, self._seq, self._anchor, -1)
                raise BackendError(f"llama_decode failed with code {rc} on "
                                   f"{self.model.path.name}")  # fmt: skip
            self.n_past += 1
            return self._last_output(self.n_embd)
        finally:
            self.eval_seconds += time.perf_counter() - t0

    def rollback(self, n_keep: int) -> None:
        """Keep the text's first ``n_keep`` positions, and remove the cells its rows left
        in the target's sequence.

        Raises:
            ValueError: ``n_keep`` is negative or beyond ``n_past``.
        """
        if not 0 <= n_keep <= self.n_past:
            raise ValueError(f"cannot roll back to {n_keep} with {self.n_past} positions")
        if self._anchor is not None:
            self._lc.llama_memory_seq_rm(self._mem, self._seq, self._anchor, -1)
            self._anchor = None
        self.n_past = n_keep

    def save_state(self) -> bytes:
        """Nothing: it holds nothing of its own (its cache is the target's)."""
        return b""

    def load_state(self, data: bytes, n_past: int) -> None:
        """Follow a text of ``n_past`` positions (the target's state holds them)."""
        self.rollback(min(self.n_past, n_past))
        self.n_past = n_past

    def token_seconds(self, repeats: int = 5) -> float:
        """Seconds per draft token: the least of ``repeats`` rows at the position after
        the target's sequence (whose cells they leave are removed again). It follows a
        text of that length afterwards."""
        end = int(self._lc.llama_memory_seq_pos_max(self._mem, self._seq)) + 1
        row = np.zeros((1, self.n_embd), np.float32)
        best = math.inf
        for _ in range(repeats):
            self.n_past = end
            t0 = time.perf_counter()
            self.eval([0], row, last=True)
            best = min(best, time.perf_counter() - t0)
            self.rollback(end)
        return best


def _meta_str(model: LlamaModel, key: str) -> str:
    """A string of ``model``'s metadata ("" where it has none)."""
    buf = ctypes.create_string_buffer(64)
    n = model._lc.llama_model_meta_val_str(model.handle, key.encode(), buf, len(buf))
    return buf.value.decode(errors="replace") if n >= 0 else ""


def _meta_int(model: LlamaModel, key: str) -> int:
    """An integer of ``model``'s metadata (0 where it has none)."""
    buf = ctypes.create_string_buffer(32)
    n = model._lc.llama_model_meta_val_str(model.handle, key.encode(), buf, len(buf))
    try:
        return int(buf.value) if n > 0 else 0
    except ValueError:
        return 0


def head_target_layers(model: LlamaModel) -> tuple[int, ...]:
    """The target's layers whose inputs a draft head reads (an EAGLE-3 head's or a DFlash
    draft's ``{arch}.target_layers``; empty for a model that is none)."""
    ext = _ext()
    n = int(ext["target_layers_n"](model.handle))
    ptr = ext["target_layers"](model.handle)
    return tuple(int(ptr[i]) for i in range(n)) if n and ptr else ()
