"""``specgguf info`` and ``specgguf check``: what GGUF files hold, and whether a draft can
draft for a target, from metadata alone (no weights load)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, Any

import typer

from specgguf.cli.app import app, handled
from specgguf.cli.options import RegistryOpt, model_path
from specgguf.cli.output import (
    count,
    num,
    print_json,
    size,
    stderr_say,
    stdout_console,
    tok,
)
from specgguf.gguf.arch import DRAFT_HEAD_ARCHS, article

if TYPE_CHECKING:
    from pathlib import Path

    from specgguf.gguf.info import ModelInfo


@app.command()
@handled
def info(
    model: Annotated[
        str, typer.Argument(help="A .gguf file (first shard of a split model) or an alias.")
    ],
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
    registry: RegistryOpt = None,
) -> None:
    """Show what a GGUF model holds, from its metadata alone (no weights load).

    Problems that would make llama.cpp refuse the file are printed on stderr (in JSON,
    under "findings"). Exits 3 when the file is missing or not a readable GGUF file; a
    file llama.cpp would refuse (a split model with a shard missing, say) is exit 0 here,
    and the "loadable" row (in JSON, "load_refusal") says why and that check, run, serve
    and bench exit 3 for it.
    """
    from specgguf.gguf.info import read_model_info

    path = model_path(model, registry)
    info = read_model_info(path)
    if info.architecture == "clip":  # a projector (--mmproj): no language model's table
        _projector(path, json_out)
        return
    mi = info.as_dict()
    mi["load_refusal"] = load_refusal(info)
    _print_findings(info.findings)
    if json_out:
        print_json(mi)
        return
    from rich.table import Table

    v = mi["vocab"]
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    shards = f"{mi['split_count']}"
    if mi["missing_shards"]:
        shards += f" ({len(mi['missing_shards'])} missing: {', '.join(mi['missing_shards'])})"
    rows = [
        ("file", mi["path"]),
        ("name", mi["name"] or "-"),
        ("architecture", mi["architecture"] or "-"),
        ("memory", _memory(mi)),
        *([] if mi["architecture"] in DRAFT_HEAD_ARCHS else [
            ("MTP layers", str(mi["nextn_layers"]) if mi["nextn_layers"] else "none")]),
        *([("draft head", _head(mi))] if mi["target_layers"] or mi["target_width"] else []),
        ("size label", mi["size_label"] or "-"),
        ("quantization", mi["quantization"] or "-"),
        ("parameters", count(mi["n_params"])),
        ("context length", num(mi["context_length"])),
        ("blocks", num(mi["block_count"])),
        ("embedding length", num(mi["embedding_length"])),
        ("heads / KV heads", f"{mi['head_count'] or '-'} / {mi['head_count_kv'] or '-'}"),
        ("tokenizer", f"{v['tokenizer_model']} ({v['vocab_type'].upper()}), "
                      f"pre-tokenizer {v['pre_tokenizer'] or '-'}"),
        ("tokens", f"{v['n_tokens']:,}" + (f", {v['n_merges']:,} merges" if v["n_merges"] else "")),
        ("BOS", tok(v["bos"]) + f" (add_bos {str(v['add_bos']).lower()})"),
        ("EOS", tok(v["eos"]) + f" (add_eos {str(v['add_eos']).lower()})"),
        ("EOT", tok(v["eot"])),
        ("padding", tok(v["padding"])),
        ("end of generation", ", ".join(tok(x) for x in v["eog"]) or "-"),
        ("chat template", "yes" if mi["has_chat_template"] else "no"),
        ("tensors", f"{mi['n_tensors']:,}"),
        ("file size", f"{mi['file_size']:,} bytes ({size(mi['file_size'])})"),
        ("splits", shards),
        ("GGUF version", str(mi["gguf_version"])),
        ("loadable", loadable_text(mi["load_refusal"])),
    ]  # fmt: skip
    for k, val in rows:
        t.add_row(k, val)
    stdout_console().print(t)


def _projector(path: Path, json_out: bool) -> None:
    """``info`` of a multimodal projector: what it reads and for which target."""
    from rich.table import Table

    from specgguf.gguf.projector import projector_info

    p = projector_info(path)
    if json_out:
        print_json({"path": str(path), "architecture": "clip", "projector": p,
                    "file_size": path.stat().st_size})  # fmt: skip
        return
    reads = [k for k in ("vision", "audio") if p[k]]
    t = Table(show_header=False, box=None, pad_edge=False)
    t.add_column(style="bold")
    t.add_column(overflow="fold")
    side, patch = p["image_size"], p["patch_size"]
    for k, val in [
        ("file", str(path)),
        ("name", str(p["name"] or "-")),
        ("architecture", "clip: a multimodal projector (--mmproj), beside its target"),
        ("projector type", str(p["projector_type"] or "-")),
        ("reads", ", ".join("images" if r == "vision" else r for r in reads) or "-"),
        ("image / patch size", f"{side or '-'} / {patch or '-'} pixels"),
        ("vision tower", f"{p['block_count'] or '-'} blocks, width {p['embedding_length'] or '-'}"
                         f", {p['head_count'] or '-'} heads"),
        ("audio encoder", f"{p['audio_mel_bins'] or '-'} mel bands, {p['audio_block_count'] or '-'}"
                          f" blocks, width {p['audio_embedding_length'] or '-'}, "
                          f"{p['audio_head_count'] or '-'} heads"),
        ("rows of", f"{p['projection_dim'] or '-'} values (the target's embedding length)"),
        ("file size", f"{path.stat().st_size:,} bytes ({size(path.stat().st_size)})"),
    ]:  # fmt: skip
        if k in ("image / patch size", "vision tower") and not p["vision"]:
            continue
        if k == "audio encoder" and not p["audio"]:
            continue
        t.add_row(k, val)
    stdout_console().print(t)


#: The commands that load the model's weights, or refuse from its metadata first as
#: ``check`` does: each exits with :class:`ModelLoadError`'s code for a file llama.cpp
#: would refuse (``info`` and ``plan`` read the metadata alone, say so and exit 0).
LOADING_COMMANDS = ("check", "run", "serve", "bench")


def load_refusal(info: ModelInfo) -> dict[str, Any] | None:
    """None when llama.cpp would load the file; else why not (the first problem, as the
    error of the commands that load it says), how many more, and their exit code."""
    from specgguf.errors import ModelLoadError

    reasons = [f.message for f in info.load_errors]
    if not reasons:
        return None
    return {
        "reason": reasons[0],
        "more": len(reasons) - 1,
        "exit_code": ModelLoadError(info.path, reasons).exit_code,
        "commands": list(LOADING_COMMANDS),
    }


def loadable_text(refusal: dict[str, Any] | None) -> str:
    """``yes (...)``, or ``no: shard 2 of 3 is missing: ... (+1 more); check, run, serve
    and bench exit 3 for it``."""
    if refusal is None:
        return "yes (as far as its metadata shows)"
    more = f" (+{refusal['more']} more)" if refusal["more"] else ""
    *first, last = refusal["commands"]
    return (f"no: {refusal['reason']}{more}; {', '.join(first)} and {last} exit "
            f"{refusal['exit_code']} for it")  # fmt: skip


def _head(mi: dict[str, Any]) -> str:
    """``an eagle3 head for a target 4096 wide, reading the inputs of its layers 2, 16, 29;
    32,000 ids of its own (d2t)``: what a draft head needs of its target."""
    vocab = (f"{mi['draft_vocab']:,} ids of its own mapped onto the target's (d2t)"
             if mi["draft_vocab"] else "the target's vocabulary")  # fmt: skip
    layers = mi["target_layers"]
    reads = (f"reading the inputs of its layer{'s' * (len(layers) > 1)} "
             f"{', '.join(map(str, layers))}" if layers
             else "reading its KV cache and hidden states")  # fmt: skip
    block = (f"; blocks of {mi['draft_block']} (drafts of at most {mi['draft_block_max']} "
             "tokens)" if mi["draft_block"] else "")  # fmt: skip
    if mi["selector_top_k"]:
        block += f"; DFlash2: a selector over each row's best {mi['selector_top_k']}"
    if mi["markov_head"]:
        block += ("; DSpark: a Markov head" + " and a confidence head, which --draft-p-min "
                  "reads" * mi["confidence_head"])  # fmt: skip
    return (
        f"{article(arch := mi['architecture'])} {arch} head for a target "
        f"{mi['target_width'] or '?'} wide, {reads}; {vocab}{block}; give it with -md beside "
        "its target"
    )


def _memory(mi: dict[str, Any]) -> str:
    """``KV cache``, or ``hybrid: KV cache + recurrent state (2 layers, 11.0 KiB per
    sequence), rolled back by snapshots``."""
    if mi["architecture"] == "gemma4-assistant":
        return "none of its own: it reads the target's KV cache"
    if mi["memory"] == "attention":
        return "KV cache"
    state = (f"recurrent state ({mi['recurrent_layers']} layers, "
             f"{size(mi['recurrent_state_bytes'])} per sequence)")  # fmt: skip
    what = state if mi["memory"] == "recurrent" else f"hybrid: KV cache + {state}"
    how = ("rolled back by snapshots" if mi["rolls_back"]
           else "no snapshots in this llama.cpp: rolled back by checkpoint and replay")  # fmt: skip
    return f"{what}, {how}"


def _print_findings(findings: Any) -> None:
    """One stderr line per finding: what llama.cpp would refuse, then warnings."""
    say = stderr_say()
    for f in findings:
        if f.severity == "error":
            say(f"specgguf: warning: llama.cpp cannot load this file: {f.message}")
        elif f.severity == "warning":
            say(f"specgguf: warning: {f.message}")


@app.command()
@handled
def check(
    target: Annotated[str, typer.Argument(help="The target model (.gguf or alias).")],
    draft: Annotated[str, typer.Argument(help="The draft model (.gguf or alias).")],
    json_out: Annotated[bool, typer.Option("--json", help="Print the report as JSON.")] = False,
    registry: RegistryOpt = None,
) -> None:
    """Tell whether DRAFT can draft for TARGET, from their vocabularies (no weights load).

    Exit codes: 0 compatible, 4 incompatible, 3 a file is missing, unreadable, or one
    llama.cpp would refuse to load.
    """
    from specgguf.errors import EXIT_INCOMPATIBLE
    from specgguf.gguf.vocab import check_compatibility

    report = check_compatibility(model_path(target, registry), model_path(draft, registry))
    if json_out:
        print_json(report.as_dict())
    else:
        _print_check(report)
    if not report.compatible:
        raise typer.Exit(EXIT_INCOMPATIBLE)


def _print_check(report: Any) -> None:
    from rich.table import Table

    from specgguf.gguf.arch import describe

    con = stdout_console()
    t = Table(box=None, pad_edge=False, header_style="bold")
    t.add_column("")
    t.add_column("target", overflow="fold")
    t.add_column("draft", overflow="fold")
    tv, dv = report.target.as_dict(), report.draft.as_dict()
    t.add_row("file", str(report.target.path), str(report.draft.path))
    t.add_row("architecture", report.target.architecture or "-", report.draft.architecture or "-")
    t.add_row("memory", *(describe(v.architecture) for v in (report.target, report.draft)))
    for label, key in (("tokenizer", "tokenizer_model"), ("pre-tokenizer", "pre_tokenizer")):
        t.add_row(label, str(tv[key]), str(dv[key]))
    t.add_row("tokens", f"{tv['n_tokens']:,}", f"{dv['n_tokens']:,}")
    t.add_row("merges", f"{tv['n_merges']:,}", f"{dv['n_merges']:,}")
    for label, key in (("BOS", "bos"), ("EOS", "eos"), ("EOT", "eot")):
        t.add_row(label, tok(tv[key]), tok(dv[key]))
    t.add_row("add_bos / add_eos", f"{tv['add_bos']} / {tv['add_eos']}".lower(),
              f"{dv['add_bos']} / {dv['add_eos']}".lower())  # fmt: skip
    con.print(t)
    d = report.token_diff
    if d.n_compared:
        con.print(f"token texts: {d.n_different:,} of {d.n_compared:,} ids differ (ids 5.."
                  f"{5 + d.n_compared - 1})", highlight=False, markup=False)  # fmt: skip
    for f in report.findings:
        con.print(f"{f.severity}: [{f.code}] {f.message}", highlight=False, markup=False)
    con.print(report.verdict(), highlight=False, markup=False)
