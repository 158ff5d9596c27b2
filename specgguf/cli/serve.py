"""``specgguf serve``: flags in, one engine configuration, the engine loaded once, an
OpenAI-compatible HTTP server over it (:mod:`specgguf.server`)."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, TypeVar

import typer

from specgguf.cli import options as o
from specgguf.cli.app import GroupedCommand, app, handled, setup_logging
from specgguf.cli.flags import config_args, takes
from specgguf.cli.output import say_calibration, stderr_say
from specgguf.errors import EXIT_INTERRUPTED
from specgguf.gguf.arch import article

if TYPE_CHECKING:
    from specgguf.engine import EngineConfig
    from specgguf.engine.preflight import Preflight


@app.command(cls=GroupedCommand, context_settings={"allow_interspersed_args": True})
@handled
@takes(load=o.ModelOptions, drafting=o.DraftOptions, sampling=o.SamplingOptions,
       server=o.ServerOptions, cache=o.CacheOptions)  # fmt: skip
def serve(
    *,
    load: o.ModelOptions,
    drafting: o.DraftOptions,
    cache: o.CacheOptions,
    n_predict: Annotated[
        int,
        typer.Option(
            "-n",
            "--n-predict",
            min=-1,
            help="Tokens per response when a request sets no max_tokens (-1: until done).",
        ),
    ] = -1,
    sampling: o.SamplingOptions,
    server: o.ServerOptions,
    quiet: o.QuietOpt = False,
    verbose: Annotated[
        bool,
        typer.Option(
            "-v", "--verbose", help="llama.cpp's logs, and each request's prompt and completion."
        ),
    ] = False,
) -> None:
    """Serve the models over HTTP with an OpenAI-compatible API (chat and text
    completions, streamed or whole), up to --parallel requests at once, with the
    speculative statistics in every response.

    Without -m, the registry's default pair is used (and downloaded on first use). The
    models load once; then one line on stderr says where the server listens. The sampling
    flags and -n are the defaults of requests that do not set them. SIGINT or SIGTERM
    stops it.

    With --rpc, the target's layers go to RPC servers (`specgguf rpc-server`), each
    asked before anything loads; a server lost while serving ends the server (exit 9).

    A request reuses what its sequence's cache shares with its prompt (a conversation's
    earlier turns are not read again); a request goes to the sequence that shares the
    most, and the prompts of sequences another request takes over are kept in
    --cache-ram (and --cache-dir) for later.

    Exit codes: 0 stopped, 2 usage (a taken port too), 3 model file, 4 incompatible draft,
    5 does not fit, 6 an RPC server does not answer, 9 llama.cpp error (an RPC server
    lost).
    """
    from specgguf.engine import Engine
    from specgguf.errors import UsageError
    from specgguf.server import ServerSettings, bind, serve
    from specgguf.server.listen import is_loopback
    from specgguf.server.scheduler import engine_thread

    # SIGTERM before the server listens (downloads, loading, calibration) ends it as
    # Ctrl-C does (exit 130); once it listens, uvicorn takes both signals (exit 0).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    setup_logging(verbose=verbose, quiet=quiet)
    # One line per request (INFO); with -v the text of prompts and completions (DEBUG).
    logging.getLogger("specgguf.server").setLevel(
        logging.ERROR if quiet else logging.DEBUG if verbose else logging.INFO
    )
    say = stderr_say(quiet)
    if "*" in config_args(server, "server").get("cors_origins", ()) and not server.api_key:
        raise UsageError("--cors-origins '*' lets every web page use the server: give "
                         "--api-key too, or name the origins")  # fmt: skip
    o.cache_config(cache)  # its refusals before anything is downloaded or loaded
    config = o.engine_config(load, drafting, say=say, media=True)
    # A projector asked for (--mmproj) where no image could be read is refused; one the -hf
    # repository brought is left out, said on stderr: the text model serves as before.
    pulled = load.mmproj is None and config.mmproj is not None

    def no_images(why: str) -> None:
        assert config.mmproj is not None
        if not pulled:
            raise UsageError(f"--mmproj {config.mmproj.name}: media with {why} are not "
                             "supported yet (leave out --mmproj to serve text)")  # fmt: skip
        say(f"specgguf: note: media with {why} are not supported yet: the projector "
            f"{config.mmproj.name} of the -hf repository is left out")  # fmt: skip

    if config.mmproj is not None and config.deterministic:
        no_images("deterministic mode")
        config = dataclasses.replace(config, mmproj=None, mmproj_draft=None)
    # Loaded once and read for every token: huge pages for the weights (specgguf.llama.hugepages).
    config = dataclasses.replace(
        config,
        target=dataclasses.replace(config.target, huge_pages=True),
        draft=config.draft and dataclasses.replace(config.draft, huge_pages=True),
        cache=o.cache_config(cache),
    )
    config, checked = _parallel(config, server.parallel, say)  # before any weights load
    if cache.cache_ram is None:  # what the memory plan leaves, up to llama-server's default
        from specgguf.engine.preflight import memory_left

        ram = min(o.CACHE_MIB << 20, memory_left(checked) // 2) >> 20 << 20
        config = dataclasses.replace(config, cache=o.cache_config(cache, ram=ram))
    sock = bind(server.host, server.port)  # a taken port is reported before loading too
    if not is_loopback(sock) and not server.api_key:
        say(
            f"specgguf: warning: listening on {server.host} without --api-key: anyone who can "
            "reach this address can use the server"
        )
    # The model's name: the alias it was loaded by, else its file name.
    target = config.target.path
    alias = load.model if load.model and not o.is_model_file(load.model) else None
    settings = ServerSettings(
        model_id=alias or target.name,
        model_aliases=tuple(n for n in (alias, target.name, target.stem) if n),
        n_predict=n_predict, sampler=sampling.sampler(), log_text=verbose,
        **config_args(server, "server"),
    )  # fmt: skip
    if config.mmproj is not None:  # images come in the body, in base64
        settings = dataclasses.replace(settings, max_body_bytes=MEDIA_BODY_BYTES)
    # Every llama.cpp call (load, calibration, generations) on one thread: a second
    # computing thread slows llama.cpp's OpenMP pools (see engine_thread).
    llama_thread = engine_thread()
    try:
        engine = _before_listening(llama_thread.submit(Engine, config, checked=checked))
        with engine:
            if config.mmproj is not None and (why := engine.media_refusal()):
                no_images(why)
                engine.drop_projector()
            if config.speculative.drafter == "auto":
                # calibrate now, not in the first request
                say_calibration(engine, say)
                _before_listening(llama_thread.submit(engine.timings))
            # Once listening, a second SIGTERM while the server stops ends it (as before
            # the handler above): uvicorn puts back the handler it found.
            signal.signal(signal.SIGTERM, signal.SIG_DFL)

            def ready(url: str) -> None:
                d = engine.describe()
                draft_name = Path(d["draft"]).name if d["draft"] else "none"
                if d["draft"] and d["head"]:
                    draft_name += f" ({article(d['head'])} {d['head']} head)"
                elif d["mtp_layers"]:
                    draft_name = f"the target's {d['mtp_layers']} MTP layer(s)"
                servers = "".join(
                    f", {role} over RPC {','.join(d[key])}"
                    for role, key in (("target", "rpc"), ("draft", "rpc_draft"))
                    if d[key]
                )
                n_par = config.n_parallel
                kept = f", prompt cache {config.cache.ram >> 20} MiB"
                if config.cache.disk_dir is not None:
                    kept += f" + {config.cache.disk >> 20} MiB in {config.cache.disk_dir}"
                say(
                    f"specgguf: listening on {url} (model {settings.model_id}, draft "
                    f"{draft_name}, drafter {d['drafter']}, parallel {n_par}, n_ctx "
                    f"{d['n_ctx']}{' each' if n_par > 1 else ''}{kept}{servers})"
                )

            serve(engine, settings, sock, on_ready=ready, executor=llama_thread)
            if config.cache.disk_dir is not None:  # for the next server
                kept = llama_thread.submit(engine.keep_prompts).result()
                say(f"specgguf: {kept} prompt(s) saved in {config.cache.disk_dir}")
    finally:
        llama_thread.shutdown(wait=False, cancel_futures=True)
        sock.close()


T = TypeVar("T")

#: ``--parallel`` when not given, where the memory plan allows it.
DEFAULT_PARALLEL = 4
#: The largest request body with ``--mmproj`` (images in base64 data: URIs: about 24 MB
#: of image); without, :attr:`ServerSettings.max_body_bytes`'s default.
MEDIA_BODY_BYTES = 32 << 20


def _parallel(
    config: EngineConfig, parallel: int | None, say: Callable[[str], None]
) -> tuple[EngineConfig, Preflight]:
    """The configuration with its parallel sequences, and its preflight: ``parallel`` as
    given (refused with the memory plan's numbers when it does not fit), else
    :data:`DEFAULT_PARALLEL` where the plan allows it and nothing needs one sequence
    (a recurrent draft model), else 1; said on stderr.

    Raises:
        InsufficientMemoryError, UsageError: from :func:`specgguf.engine.preflight`.
    """
    from specgguf.engine import preflight
    from specgguf.errors import InsufficientMemoryError, UsageError

    if parallel is not None:
        config = dataclasses.replace(config, n_parallel=parallel)
        return config, preflight(config)
    wide = dataclasses.replace(config, n_parallel=DEFAULT_PARALLEL)
    try:
        checked = preflight(wide)
    except InsufficientMemoryError as e:
        why = f"{DEFAULT_PARALLEL} would not fit ({e})"
    except UsageError as e:
        why = str(e)
    else:
        return wide, checked
    one = preflight(config)
    say(f"specgguf: one request at a time (--parallel 1): {why}")
    return config, one


def _before_listening(future: Future[T]) -> T:
    """The result of the engine thread's load or calibration. Ctrl-C or SIGTERM meanwhile
    exits at once (130): llama.cpp cannot be stopped in the middle of either, and the
    interpreter would wait for that thread (seconds). Nothing is written then but the
    calibration cache, which is replaced atomically."""
    try:
        return future.result()
    except KeyboardInterrupt:
        os._exit(EXIT_INTERRUPTED)
