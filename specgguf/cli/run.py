"""``specgguf run``: flags in, one engine configuration, one generation, text out."""

from __future__ import annotations

import dataclasses
import secrets
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from specgguf.cli import options as o
from specgguf.cli.app import GroupedCommand, app, handled, setup_logging
from specgguf.cli.flags import takes
from specgguf.cli.output import print_json, say_calibration, stderr_say

if TYPE_CHECKING:
    from specgguf.engine import Engine


@app.command(cls=GroupedCommand, context_settings={"allow_interspersed_args": True})
@handled
@takes(load=o.ModelOptions, drafting=o.DraftOptions, sampling=o.SamplingOptions)
def run(
    prompt: Annotated[
        str | None,
        typer.Argument(help="The prompt; '-' or omitted with piped input reads stdin."),
    ] = None,
    *,
    load: o.ModelOptions,
    drafting: o.DraftOptions,
    n_predict: Annotated[
        int,
        typer.Option("-n", "--n-predict", min=-1, help="Tokens to generate (-1: until done)."),
    ] = -1,
    sampling: o.SamplingOptions,
    stop: Annotated[
        list[str] | None, typer.Option("--stop", help="Stop string (repeatable).")
    ] = None,
    ignore_eos: Annotated[
        bool, typer.Option("--ignore-eos", help="Never generate end-of-generation tokens.")
    ] = False,
    prompt_opt: Annotated[
        str | None,
        typer.Option("-p", "--prompt", help="The prompt, as llama.cpp takes it (or the argument)."),
    ] = None,
    file: Annotated[
        Path | None, typer.Option("-f", "--file", help="Read the prompt from a file.")
    ] = None,
    system: Annotated[
        str | None, typer.Option("--system", help="System message for the chat template.")
    ] = None,
    raw: Annotated[
        bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")
    ] = False,
    json_out: Annotated[
        bool, typer.Option("--json", help="One JSON object at the end instead of text.")
    ] = False,
    json_schema: Annotated[
        str | None,
        typer.Option("-j", "--json-schema", help="Output JSON valid against this JSON Schema."),
    ] = None,
    json_schema_file: Annotated[
        Path | None,
        typer.Option("-jf", "--json-schema-file", help="--json-schema read from a file."),
    ] = None,
    grammar: Annotated[
        str | None,
        typer.Option("--grammar", help="Output held to this GBNF grammar (llama.cpp's)."),
    ] = None,
    grammar_file: Annotated[
        Path | None, typer.Option("--grammar-file", help="--grammar read from a file.")
    ] = None,
    image: Annotated[
        list[Path] | None,
        typer.Option(
            "--image",
            metavar="FILE",
            help="An image the target reads with --mmproj (repeatable, as llama-mtmd-cli's): "
            "where the prompt has the marker <__media__>, else before it.",
        ),
    ] = None,
    audio: Annotated[
        list[Path] | None,
        typer.Option(
            "--audio",
            metavar="FILE",
            help="An audio clip (WAV, MP3, FLAC) the target reads with --mmproj (repeatable, "
            "as llama-mtmd-cli's), after every --image.",
        ),
    ] = None,
    prompt_cache: Annotated[
        Path | None,
        typer.Option(
            "--prompt-cache",
            metavar="FILE",
            help="Reuse the state a run with the same start of prompt saved here (same models "
            "and settings), and save this run's there (a link: the file it names; missing "
            "folders are made).",
        ),
    ] = None,
    prompt_cache_ro: Annotated[
        bool,
        typer.Option("--prompt-cache-ro", help="Reuse --prompt-cache, do not update it."),
    ] = False,
    quiet: o.QuietOpt = False,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="llama.cpp's logs.")] = False,
) -> None:
    """Generate with speculative decoding: text on stdout, rates on stderr.

    Without -m, the registry's default pair is used (and downloaded on first use). With
    -m and no -md, a compatible draft model already on disk is chosen, and stderr says
    which and why (`specgguf list --drafts-for TARGET` lists them).

    With --json-schema or --grammar, the output follows the grammar; speculation stays on
    (drafts are cut where the grammar forbids them, and tokens the grammar forces are
    drafted without a drafter).

    With --prompt-cache FILE, a run whose prompt starts as the saved one's did reads only
    the rest (a shell loop over one long document reads it once); a file of other models
    or settings, or damaged, is ignored with one line on stderr and written again.

    Exit codes: 0 done, 2 usage (a schema or grammar that cannot be used too), 3 model
    file, 4 incompatible draft, 5 does not fit, 6 an RPC server does not answer, 9
    llama.cpp error (an RPC server lost), 130 interrupted, 141 stdout closed.
    """
    from specgguf.cli.display import (
        LOSS_MIN_TOKENS,
        LoadProgress,
        gain_line,
        live_allowed,
        loss_line,
        speculation_lost,
        stream,
        summary_line,
    )
    from specgguf.cli.prompt import read_prompt
    from specgguf.engine import Engine, preflight, render_prompt
    from specgguf.errors import Interrupted, UsageError
    from specgguf.llama.media import MARKER
    from specgguf.speculative.loop import GenerationParams

    setup_logging(verbose=verbose, quiet=quiet)
    say = stderr_say(quiet)
    spec = o.grammar_spec(json_schema, json_schema_file, grammar, grammar_file)
    config = o.engine_config(load, drafting, say=say, media=True)
    if raw and system is not None:
        raise UsageError("--system needs the chat template, and --raw sends the prompt without it")
    if prompt_cache_ro and prompt_cache is None:
        raise UsageError("--prompt-cache-ro reads the file --prompt-cache names: give one")
    if prompt_cache is not None:
        check_cache_file(prompt_cache, say, read_only=prompt_cache_ro)
    if prompt_opt is not None:
        if prompt is not None:
            raise UsageError("give the prompt as an argument or with -p/--prompt, not both")
        prompt = prompt_opt
    text = read_prompt(prompt, file)
    media = read_media(image or [], text, projector=config.mmproj, audio=audio or [])
    if media and prompt_cache is not None:
        raise UsageError("--prompt-cache does not keep media yet: leave out one of them")
    if media and MARKER not in text:  # one marker before the text for each, as llama-mtmd-cli
        text = MARKER * len(media) + text
    checked = preflight(config)  # before any weights load; the template too
    if media and config.deterministic:
        raise UsageError("media with deterministic mode are not supported yet")
    messages = [{"role": "system", "content": system}] if system is not None else []
    conversation = text if raw else [*messages, {"role": "user", "content": text}]
    render_prompt(checked.target, conversation)  # its faults before any weights load
    sampler = sampling.sampler()
    if sampler.seed is None:  # drawn here, so that --json can tell it
        sampler = dataclasses.replace(sampler, seed=secrets.randbits(32))
    params = GenerationParams(n_predict=n_predict, sampler=sampler, stop=tuple(stop or ()),
                              ignore_eos=ignore_eos, grammar=spec)  # fmt: skip
    sizes = {m.path: m.file_size for m in (checked.target, checked.draft) if m is not None}
    with LoadProgress(sizes, quiet=quiet) as progress:
        engine = Engine(config, checked=checked, on_load_progress=progress)
    with engine:
        # rendered again with the loaded vocabulary's control tokens kept out of the text
        prepared = engine.render(conversation)
        ids, spans = engine.media_prompt(prepared, media)
        if config.speculative.drafter == "auto":
            say_calibration(engine, say, deterministic=config.deterministic)
        if prompt_cache is not None:
            recall_prompt(engine, prompt_cache, say, read_only=prompt_cache_ro)
        gen = engine.generate(ids, params, media=spans)
        # The live panel compares a forced drafter with the target alone (auto mode weighs
        # it at every step itself); the last line compares both.
        forced = config.speculative.drafter not in ("auto", "none")
        alone = engine.target_alone_rate(measure=False) if forced else None
        live = not quiet and not json_out and live_allowed()
        result, interrupted = stream(gen, write=not json_out, live=live, target_alone=alone)
        if prompt_cache is not None and not prompt_cache_ro and not interrupted:
            # saved before anything else evaluates on the target (a rate measured below)
            keep_prompt(engine, prompt_cache, say)
        if config.speculative.drafter != "none" and not interrupted:
            # at the run's mean depth, and for auto mode with what its run learned of the
            # timings; a forced drafter measures it now where nothing is calibrated
            depth = len(ids) + result.stats.generated // 2
            alone = engine.target_alone_rate(measure=forced, cached=depth) or alone
        if alone and result.stats.steps:
            # The target alone pays this run's Python time per step too (on tiny models
            # a good part of the time), but not the planner's.
            s = result.stats
            own = max(0.0, s.python_seconds - s.plan_seconds)
            alone = 1.0 / (1.0 / alone + own / s.steps)
        if json_out:
            print_json({
                "text": result.text,
                "tokens": result.tokens,
                "finish_reason": result.finish_reason,
                "stats": {**result.stats.as_dict(), "target_alone_tokens_per_s":
                          round(alone, 3) if alone else None},
                "models": {**{k: engine.describe()[k] for k in ("target", "draft", "rpc",
                                                                 "rpc_draft")},
                           "drafter": config.speculative.drafter,
                           "mmproj": str(config.mmproj) if config.mmproj else None},
                "images": [str(path) for path in image or []],
                "audio": [str(path) for path in audio or []],
                "params": {
                    "draft_max": result.stats.draft_max,
                    "draft_min": config.speculative.draft_min, "n_predict": n_predict,
                    "n_ctx": checked.n_ctx, "temperature": sampler.temperature,
                    "top_k": sampler.top_k, "top_p": sampler.top_p, "min_p": sampler.min_p,
                    "seed": sampler.seed,
                    "stop": list(params.stop), "chat_template": prepared.templated,
                    "grammar": spec.kind if spec is not None else None,
                    "prompt_tokens": len(ids), "deterministic": config.deterministic,
                },
            })  # fmt: skip
        elif sys.stdout.isatty() and result.text and not result.text.endswith("\n"):
            print(file=sys.stderr)
        if prompt_cache is not None:
            s = result.stats
            say(f"specgguf: prompt cache {prompt_cache}: {s.prompt_cached} of {s.prompt_tokens} "
                f"prompt tokens reused, {s.prompt_read} read")  # fmt: skip
        say(summary_line(result.stats, result.finish_reason))
        if forced and alone is not None and speculation_lost(result.stats, alone):
            say(loss_line(result.stats, alone))
        elif alone and result.stats.generated >= LOSS_MIN_TOKENS:
            say(gain_line(result.stats, alone))
        if interrupted:
            raise Interrupted()


def read_media(
    images: Sequence[Path], text: str, *, projector: Path | None, audio: Sequence[Path] = ()
) -> list[tuple[str, bytes]]:
    """The ``--image`` files' and then the ``--audio`` files' names and bytes, checked
    before any weights load: each a readable file within
    :data:`specgguf.llama.media.MAX_BYTES` that the ``projector`` file says it reads (by
    its metadata), within :data:`~specgguf.llama.media.MAX_PIXELS` for the image formats
    whose header says, and :data:`~specgguf.llama.audio.MAX_SECONDS` for a clip; as many
    as the prompt's markers where it has any.

    Raises:
        MediaError: a missing, unreadable, empty or oversized medium, one of a kind the
            projector does not read, or media without --mmproj.
        UsageError: markers in the prompt that do not match the media in number.
        ModelNotFoundError, ModelFileError: the projector file is missing or not one.
    """
    from specgguf.errors import MediaError, UsageError
    from specgguf.gguf.projector import check_projector, projector_reads
    from specgguf.llama.media import MARKER, MAX_BYTES, check_medium

    given = [("--image", path) for path in images] + [("--audio", path) for path in audio]
    if not given:
        return []
    if projector is None:
        flag, path = given[0]
        what = "images" if flag == "--image" else "audio"
        raise MediaError(f"{flag} {path}: reading {what} needs the target's projector "
                         f"file: give it with --mmproj", part=str(path))  # fmt: skip
    check_projector(projector, None)
    vision, hears = projector_reads(projector)
    out = []
    for flag, path in given:
        try:
            with open(path, "rb") as f:  # (at most one byte past the limit: /dev/zero ends)
                data = f.read(MAX_BYTES + 1)
        except OSError as e:
            raise MediaError(f"{flag} {path}: {e.strerror or e}", part=str(path)) from None
        check_medium(data, str(path), vision=vision, audio=hears)
        out.append((str(path), data))
    markers = text.count(MARKER)
    if markers and markers != len(out):
        raise UsageError(f"the prompt has {markers} {MARKER} marker(s) for {len(out)} "
                         f"--image/--audio")  # fmt: skip
    return out


def check_cache_file(path: Path, say: Callable[[str], None], *, read_only: bool) -> None:
    """Refuse a ``--prompt-cache`` path that is not a file (a folder, a device: a save
    would replace it); a missing one read only is said.

    Raises:
        UsageError: the path (or what its link names) exists and is not a regular file.
    """
    from specgguf.errors import UsageError

    try:
        real = path.resolve()
        exists = real.exists()
    except (OSError, RuntimeError) as e:  # a loop of links, a folder that cannot be read
        raise UsageError(f"--prompt-cache {path}: {getattr(e, 'strerror', None) or e}") from None
    if exists and not real.is_file():
        what = "a folder" if real.is_dir() else "not a regular file"
        raise UsageError(f"--prompt-cache {path} is {what}: name a file")
    if read_only and not exists:
        say(f"specgguf: note: --prompt-cache {path} does not exist: the prompt is read whole")


def recall_prompt(
    engine: Engine, path: Path, say: Callable[[str], None], *, read_only: bool
) -> None:
    """The state saved in ``path`` into the engine's sequence, when the file is there and
    belongs to this engine's models and settings; otherwise one line says why it is
    ignored (an absent file: nothing)."""
    from specgguf.engine.prompt_cache import PromptCacheFileError, read_file
    from specgguf.errors import SpecggufError

    if not path.exists():
        return
    then = "" if read_only else ", and written again after this run"
    try:
        engine.load_prompt(read_file(path, engine.cache_identity()))
    except PromptCacheFileError as e:
        say(f"specgguf: --prompt-cache {path} is ignored ({e.reason}){then}")
    except OSError as e:
        say(f"specgguf: --prompt-cache {path} is ignored ({e.strerror or e}){then}")
    except SpecggufError as e:  # llama.cpp refused the state: the sequence is empty
        say(f"specgguf: --prompt-cache {path} is ignored ({e}){then}")


def keep_prompt(engine: Engine, path: Path, say: Callable[[str], None]) -> None:
    """What the engine's sequence holds, saved to ``path`` (whole or not at all); a
    failure is said on stderr (the output was given already)."""
    from specgguf.engine.prompt_cache import write_file
    from specgguf.errors import SpecggufError

    try:  # through a link, to the file it names
        write_file(path.resolve(), engine.save_prompt(), engine.cache_identity())
    except (OSError, SpecggufError) as e:
        say(f"specgguf: warning: --prompt-cache {path} could not be written: "
            f"{getattr(e, 'strerror', None) or e}")  # fmt: skip
