"""The error hierarchy of specgguf, and the exit code each error maps to.

Every error a user can cause derives from :class:`SpecggufError`. Each class carries the
fields that describe what went wrong (a path, a token id, expected and actual values) and
an ``exit_code`` that the command-line entry point (``specgguf.cli.main``) returns. Where a
builtin exception fits, it is a second parent, so ``except FileNotFoundError`` works too.
Messages name no command-line flag: the command line adds its hints where it maps errors
(``specgguf.cli.app``).

Exit codes (also in the README):

==== ==========================================================================
0    success (``check``: the pair is compatible)
1    unexpected internal error
2    usage error: bad flags or arguments, malformed registry file
3    model file problem: missing, unreadable, not GGUF, truncated, unknown alias, or a
     file llama.cpp would refuse to load
4    incompatible vocabularies (``check``, ``run``)
5    does not fit: memory, disk space, prompt longer than the context
6    network: the Hugging Face hub or a mirror (not found, offline and not cached), or an
     RPC server that does not answer before loading
7    access denied by the hub (gated or private repository, HTTP 401/403)
8    integrity: a downloaded file failed its size or SHA-256 check
9    llama.cpp backend error: a load or decode failed, an unsafe build, an RPC server lost
     during generation
130  interrupted (Ctrl-C)
141  stdout closed early (a broken pipe, as in ``| head``)
==== ==========================================================================
"""

from __future__ import annotations

from pathlib import Path

EXIT_INTERNAL = 1
EXIT_USAGE = 2
EXIT_MODEL_FILE = 3
EXIT_INCOMPATIBLE = 4
EXIT_RESOURCES = 5
EXIT_HUB = 6
EXIT_NETWORK = EXIT_HUB  # the hub, a mirror, an RPC server
EXIT_ACCESS = 7
EXIT_INTEGRITY = 8
EXIT_BACKEND = 9
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141


class SpecggufError(Exception):
    """Base class of every error specgguf reports to a user.

    ``str(error)`` is a one-line message a user can act on; ``hint`` an optional second
    line saying what to do about it.
    """

    exit_code: int = EXIT_INTERNAL

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(SpecggufError, ValueError):
    """A flag or argument that cannot be used as given."""

    exit_code = EXIT_USAGE


class RegistryError(SpecggufError, ValueError):
    """A models.toml registry file that cannot be read (carries the file and line)."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, path: Path | None = None, line: int | None = None) -> None:
        where = ""
        if path is not None:
            where = f"{path}:{line}: " if line is not None else f"{path}: "
        super().__init__(where + message)
        self.path = path
        self.line = line


class ModelFileError(SpecggufError):
    """A model file that cannot be used: base of the file-level errors."""

    exit_code = EXIT_MODEL_FILE

    def __init__(self, message: str, *, path: Path | str | None = None, hint: str | None = None):
        super().__init__(message, hint=hint)
        self.path = Path(path) if path is not None else None


class ModelNotFoundError(ModelFileError, FileNotFoundError):
    """A model path that does not exist, or an alias with no file in the cache."""


class UnknownModelError(ModelNotFoundError):
    """A name that is neither a file nor an alias of the registry (with close matches)."""

    def __init__(self, name: str, *, suggestions: list[str]) -> None:
        msg = f"{name!r} is neither a GGUF file nor a known model alias"
        if suggestions:
            msg += "; did you mean " + ", ".join(repr(s) for s in suggestions) + "?"
        super().__init__(msg)
        self.name = name
        self.suggestions = suggestions


class ModelNotDownloadedError(ModelNotFoundError):
    """A registry alias whose file is not in the local cache yet."""

    def __init__(self, alias: str, what: str) -> None:
        super().__init__(f"{alias} ({what}) is not downloaded")
        self.alias = alias


class GGUFFormatError(ModelFileError, ValueError):
    """A file that is not a readable GGUF file: wrong magic, version, truncated, corrupt.

    ``offset`` is the byte offset in the file where reading failed, when known.
    """

    def __init__(self, path: Path | str, reason: str, *, offset: int | None = None) -> None:
        where = f" (at byte {offset})" if offset is not None else ""
        super().__init__(f"{path}: {reason}{where}", path=path)
        self.reason = reason
        self.offset = offset


class ChatTemplateError(ModelFileError):
    """A model's chat template that cannot be rendered: a syntax error, an unknown name, a
    sandbox violation."""


class ChatTemplateBudgetError(ChatTemplateError):
    """A chat template stopped for running past its budget of time, output or memory."""


class GrammarError(UsageError):
    """A constraint on the output that cannot be used: a JSON Schema that is not valid
    JSON or uses a feature the grammar library does not support, a grammar that does not
    parse, a regular expression that does not compile. ``message`` names what is wrong."""


class ChatInputError(UsageError):
    """A conversation the model's chat template refuses (the template's own
    ``raise_exception``, e.g. roles that do not alternate); ``message`` quotes it."""


class MediaError(UsageError):
    """An image or audio clip that cannot be used (empty, too large, not a format
    llama.cpp reads, of a kind the projector does not read), or media without a
    projector; ``part`` names it (a file, or a request's content part)."""

    def __init__(self, message: str, *, part: str) -> None:
        super().__init__(message)
        self.part = part


class ToolsTemplateError(ChatInputError):
    """Tools, tool calls or tool results given to a model whose chat template does not
    render them; ``part`` says which: ``tools``, ``tool calls`` or ``tool results``."""

    def __init__(self, message: str, *, part: str) -> None:
        super().__init__(message)
        self.part = part


class ModelLoadError(ModelFileError, ValueError):
    """A GGUF file that llama.cpp would refuse to load (or abort on), found from its
    metadata and tensor directory before any weights load.

    ``reasons`` lists every problem found, the first one (the one llama.cpp meets first)
    first.
    """

    def __init__(self, path: Path | str, reasons: list[str]) -> None:
        first = reasons[0] if reasons else "unknown reason"
        more = f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
        super().__init__(f"{path}: llama.cpp cannot load this file: {first}{more}", path=path)
        self.reasons = reasons


class IncompatibleVocabError(SpecggufError, ValueError):
    """Target and draft vocabularies that cannot be used together for speculation.

    ``reasons`` lists every blocking difference, the first one first.
    """

    exit_code = EXIT_INCOMPATIBLE

    def __init__(self, reasons: list[str], *, target: Path, draft: Path) -> None:
        first = reasons[0] if reasons else "unknown reason"
        more = f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else ""
        super().__init__(
            f"draft {draft.name} is not compatible with target {target.name}: {first}{more}"
        )
        self.reasons = reasons
        self.target = target
        self.draft = draft


class ResourceError(SpecggufError):
    """Something that does not fit: memory, disk, context length."""

    exit_code = EXIT_RESOURCES


class InsufficientMemoryError(ResourceError, MemoryError):
    """The models and KV caches clearly do not fit the memory available (bytes): the
    machine's RAM, with ``gpu`` a local GPU's free memory for the offloaded layers, with
    ``remote`` an RPC server's."""

    def __init__(
        self,
        message: str,
        *,
        needed: int,
        available: int,
        gpu: bool = False,
        remote: bool = False,
    ) -> None:
        super().__init__(message)
        self.needed = needed
        self.available = available
        self.gpu = gpu
        self.remote = remote


class InsufficientDiskError(ResourceError, OSError):
    """Not enough free disk space for a download (bytes)."""

    def __init__(self, path: Path, *, needed: int, available: int) -> None:
        super().__init__(
            f"not enough free disk space in {path}: need {gib(needed)}, {gib(available)} available"
        )
        self.path = path
        self.needed = needed
        self.available = available


class ContextOverflowError(ResourceError, ValueError):
    """Tokens that do not fit a context: ``n_tokens`` needed (``n_prompt`` for a prompt;
    with ``at_least``, a lower bound on them), ``n_ctx`` available; ``draft`` when it is
    the draft model's context, ``model`` the file when known."""

    def __init__(
        self,
        n_tokens: int,
        n_ctx: int,
        *,
        prompt: bool = True,
        draft: bool = False,
        model: str | None = None,
        at_least: bool = False,
    ) -> None:
        whose = f"{model}'s" if model else "the draft model's" if draft else "the target's"
        if prompt:
            msg = (
                f"the prompt is {'at least ' if at_least else ''}{n_tokens} tokens, which "
                f"does not fit {whose} context of {n_ctx} tokens (at least one token must be "
                "left to generate)"
            )
        else:
            msg = f"{n_tokens} tokens do not fit {whose} context of {n_ctx} tokens"
        super().__init__(msg)
        self.n_tokens = self.n_prompt = n_tokens
        self.n_ctx = n_ctx
        self.draft = draft
        self.at_least = at_least


class HubError(SpecggufError):
    """A download that failed: repository or file not found, network, offline."""

    exit_code = EXIT_HUB


class HubAccessError(HubError, PermissionError):
    """The hub refused access (HTTP 401/403): a gated or private repository."""

    exit_code = EXIT_ACCESS


class QuantNotFoundError(HubError):
    """A repository (or its cached snapshot) with no GGUF model of the quant asked for;
    ``available`` lists the quants it has."""

    def __init__(self, message: str, *, repo: str, tag: str | None, available: list[str]) -> None:
        super().__init__(message)
        self.repo = repo
        self.tag = tag
        self.available = available


class IntegrityError(SpecggufError):
    """A file whose size or SHA-256 does not match what was pinned."""

    exit_code = EXIT_INTEGRITY

    def __init__(
        self, path: Path, *, what: str, expected: str, actual: str, hint: str | None = None
    ) -> None:
        super().__init__(f"{path}: {what} mismatch: expected {expected}, got {actual}", hint=hint)
        self.path = path
        self.expected = expected
        self.actual = actual


class BackendError(SpecggufError, RuntimeError):
    """llama.cpp failed: a model or context could not be created, a decode failed."""

    exit_code = EXIT_BACKEND


class RpcServerError(SpecggufError, ConnectionError):
    """An RPC server (llama.cpp's ``rpc-server``) that cannot be used, found before any
    weights load: nothing listens, it does not answer the handshake in time, it speaks
    another protocol version. ``endpoint`` is ``host:port``."""

    exit_code = EXIT_NETWORK

    def __init__(self, endpoint: str, reason: str, *, hint: str | None = None) -> None:
        super().__init__(f"RPC server {endpoint}: {reason}", hint=hint)
        self.endpoint = endpoint
        self.reason = reason


class RpcServerLost(BackendError):
    """An RPC server that stopped answering after the models were loaded on it. llama.cpp
    ends the process when this happens (``GGML_ABORT`` in ggml-rpc.cpp); this error is
    what specgguf reports just before (``endpoints``: the servers found gone, or every
    server in use when none could be singled out)."""

    def __init__(self, endpoints: list[str], detail: str) -> None:
        which = ", ".join(endpoints)
        plural = "s" if len(endpoints) > 1 else ""
        super().__init__(f"RPC server{plural} {which} stopped answering ({detail})")
        self.endpoints = endpoints
        self.detail = detail
        #: a server's open requests answered with this error (None: not a server)
        self.requests_answered: int | None = None


class Interrupted(SpecggufError):
    """The user pressed Ctrl-C (SIGINT)."""

    exit_code = EXIT_INTERRUPTED

    def __init__(self) -> None:
        super().__init__("interrupted")


class OutputClosed(SpecggufError):
    """stdout was closed by its reader (``| head``): nothing more to do, nothing to say."""

    exit_code = EXIT_BROKEN_PIPE

    def __init__(self) -> None:
        super().__init__("stdout was closed")


def gib(n: int) -> str:
    """A byte count in GiB for messages: ``1.04 GiB``."""
    return f"{n / 2**30:.2f} GiB"
