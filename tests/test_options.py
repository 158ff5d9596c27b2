"""The command-line options declared once (specgguf.cli.options, specgguf.cli.flags): each
concern's defaults reach the engine's configuration, a flag declared once appears with the
same help on every command that takes its concern, and a new option is one field."""

from __future__ import annotations

import dataclasses
import json
import signal
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from specgguf.cli import bench, full_app, plan, run, serve
from specgguf.cli import options as o
from specgguf.cli.flags import Options, config_args, flags, option, takes
from specgguf.engine.config import CacheConfig, EngineConfig, ModelConfig, SpeculativeConfig
from specgguf.speculative.sampling import SamplerParams

from .helpers import run_cli

app = full_app()

COMMANDS = {"run": run.run, "serve": serve.serve, "bench": bench.bench, "plan": plan.plan}
CONCERNS = (o.ModelOptions, o.DraftOptions, o.SamplingOptions, o.ServerOptions, o.CacheOptions)


def test_each_concerns_defaults_reach_the_engine_config(tiny_models: dict[str, Path]) -> None:
    load = o.ModelOptions(model=str(tiny_models["target"]),
                          model_draft=str(tiny_models["draft-partial"]))  # fmt: skip
    config = o.engine_config(load, o.DraftOptions())
    assert config.draft is not None
    t, d, s = config.target, config.draft, config.speculative
    assert (t.n_ctx, t.n_batch, t.n_gpu_layers, t.n_threads, t.repack) == (4096, 2048, -1, None,
                                                                           None)  # fmt: skip
    assert (t.rpc, t.tensor_split, t.devices, t.huge_pages) == ((), (), None, False)
    # The draft's context is the target's (0), its batch and layers as the target's.
    assert (d.n_ctx, d.n_batch, d.n_gpu_layers, d.n_threads, d.repack) == (0, 2048, -1, None,
                                                                           None)  # fmt: skip
    assert (s.drafter, s.draft_max, s.draft_min, s.draft_tree, s.p_min) == ("auto", 64, 0, 4, 0.0)
    assert (config.check_vocab, config.check_memory, config.deterministic,
            config.rpc_timeout) == (True, True, False, 15.0)  # fmt: skip
    assert o.SamplingOptions().sampler() == SamplerParams(0.8, 40, 0.95, 0.05, None)
    assert SamplerParams() == SamplerParams(0.8, 40, 0.95, 0.05, None)
    assert (o.ServerOptions().host, o.ServerOptions().port) == ("127.0.0.1", 8080)


def test_an_options_default_gives_its_configuration_its_own_default() -> None:
    from specgguf.server import ServerSettings

    classes: dict[str, Any] = {"target": ModelConfig, "draft": ModelConfig,
                               "engine": EngineConfig, "speculative": SpeculativeConfig,
                               "sampler": SamplerParams, "server": ServerSettings,
                               "cache": CacheConfig}  # fmt: skip
    checked = 0
    for concern in CONCERNS:
        defaults = concern()
        for name, flag in flags(concern).items():
            for to in flag.to:
                dest, _, arg = to.partition(".")
                fields = {f.name: f for f in dataclasses.fields(classes[dest])}
                assert arg in fields, f"{concern.__name__}.{name}: {to}"
                value = config_args(defaults, dest).get(arg)
                if (name, dest) == ("ctx_size_draft", "draft"):
                    assert value == 0  # the target's context, not ModelConfig's default
                    continue
                own = fields[arg].default
                if own is dataclasses.MISSING:
                    own = fields[arg].default_factory()  # type: ignore[misc]
                assert value is None or value == own, f"{concern.__name__}.{name}: {to}"
                checked += 1
    assert checked >= 25


def _click_options(name: str) -> dict[tuple[str, ...], Any]:
    """The parameters of a command, by their names (Typer's own Click's objects)."""
    group: Any = typer.main.get_command(app)
    return {tuple(p.opts): p for p in group.commands[name].params}


def test_a_flag_declared_once_appears_on_every_command_of_its_concern_with_its_help() -> None:
    declared = {f.names: f for concern in CONCERNS for f in flags(concern).values()}
    shown_on: dict[tuple[str, ...], set[str]] = {}
    for name, command in COMMANDS.items():
        params = _click_options(name)
        for opts in command.concerns.values():  # type: ignore[attr-defined]
            for field, flag in opts.shown.items():
                param = params[flag.names]
                assert getattr(param, "help", None) == flag.help, (name, field)
                assert getattr(param, "rich_help_panel", None) == flag.panel, (name, field)
                if flag == declared[flag.names]:
                    shown_on.setdefault(flag.names, set()).add(name)
    # run and serve take every model, drafting and sampling option as declared; serve the
    # server's too.
    for concern in (o.ModelOptions, o.DraftOptions, o.SamplingOptions):
        for flag in flags(concern).values():
            assert {"run", "serve"} <= shown_on[flag.names], flag.names
    assert all(shown_on[f.names] == {"serve"} for f in flags(o.ServerOptions).values())
    # the prompt cache's: serve's, and plan counts what two of them hold
    planned = {"cache_ram", "ctx_checkpoints"}
    for name, flag in flags(o.CacheOptions).items():
        assert shown_on[flag.names] == {"serve", "plan"} if name in planned else {"serve"}
    # bench and plan: the model options that matter to them, most as declared.
    assert shown_on[("-ngl", "--n-gpu-layers", "--gpu-layers")] == {"run", "serve", "bench",
                                                                   "plan"}  # fmt: skip
    assert shown_on[("-c", "--ctx-size")] == {"run", "serve", "plan"}  # bench: its own bounds
    assert ("--temp",) not in _click_options("plan") and ("--temp",) not in _click_options("bench")


@dataclasses.dataclass(frozen=True)
class HugePagesOptions(o.ModelOptions):
    """The model options and one more: a made-up loader flag for the test below."""

    huge_pages: bool = option(False, "--huge-pages", help="Huge pages for the weights.",
                              to=("target.huge_pages", "draft.huge_pages"))  # fmt: skip


def test_a_new_loader_option_is_one_field(tiny_models: dict[str, Path]) -> None:
    configs: list[EngineConfig] = []
    test_app = typer.Typer(rich_markup_mode=None)

    @test_app.command()
    @takes(load=HugePagesOptions, drafting=o.DraftOptions)
    def load_models(*, load: o.ModelOptions, drafting: o.DraftOptions) -> None:
        configs.append(o.engine_config(load, drafting))

    pair = ["-m", str(tiny_models["target"]), "-md", str(tiny_models["draft-partial"])]
    for args in (["--huge-pages", "-c", "512"], []):
        res = CliRunner().invoke(test_app, [*pair, *args])
        assert res.exit_code == 0, res.output
    on, off = configs
    assert on.draft is not None and off.draft is not None
    assert (on.target.huge_pages, on.draft.huge_pages, on.target.n_ctx) == (True, True, 512)
    assert (off.target.huge_pages, off.draft.huge_pages, off.target.n_ctx) == (False, False, 4096)
    help_text = CliRunner().invoke(test_app, ["--help"]).output
    assert "--huge-pages" in help_text and "Huge pages for the weights." in help_text


class _Stop(Exception):
    pass


@pytest.mark.parametrize("command", ["run", "serve"])
def test_flags_reach_the_engine_config_alike_on_run_and_serve(
    command: str, tiny_models: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[tuple[o.ModelOptions, o.DraftOptions | None]] = []

    def capture(load: o.ModelOptions, drafting: o.DraftOptions | None = None, **_: Any) -> Any:
        seen.append((load, drafting))
        raise _Stop  # nothing loads

    monkeypatch.setattr(o, "engine_config", capture)
    sigterm = signal.getsignal(signal.SIGTERM)  # serve sets its own
    try:
        res = CliRunner().invoke(app, [
            command, "-m", str(tiny_models["target"]), "-md", str(tiny_models["draft-partial"]),
            "-c", "512", "-cd", "256", "-b", "64", "-t", "3", "-ngl", "5", "-ngld", "all", "-nr",
            "--no-check", "--force", "--deterministic", "--rpc-timeout", "2.5",
            "--spec-draft-n-max", "3", "--draft-min", "2", "--draft-tree", "0",
            "--draft-p-min", "0.25", "--drafter", "model",
        ])  # fmt: skip
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    assert isinstance(res.exception, _Stop), res.output
    monkeypatch.undo()
    config = o.engine_config(*seen[0])
    assert config.draft is not None
    t, d, s = config.target, config.draft, config.speculative
    assert (t.n_ctx, t.n_batch, t.n_threads, t.n_gpu_layers, t.repack) == (512, 64, 3, 5, False)
    assert (d.n_ctx, d.n_batch, d.n_threads, d.n_gpu_layers, d.repack) == (256, 64, 3, -1, False)
    assert (s.drafter, s.draft_max, s.draft_min, s.draft_tree, s.p_min) == ("model", 3, 2, 0,
                                                                            0.25)  # fmt: skip
    assert (config.check_vocab, config.check_memory, config.deterministic,
            config.rpc_timeout) == (False, False, True, 2.5)  # fmt: skip


def test_sampling_flags_and_defaults_reach_a_generation(tiny_models: dict[str, Path]) -> None:
    base = ["run", "-m", str(tiny_models["target"]), "--drafter", "none", "-n", "2", "--raw",
            "--json", "-q"]  # fmt: skip
    keys = ("temperature", "top_k", "top_p", "min_p")
    given = run_cli(*base, "--temp", "0", "--top-k", "7", "--top-p", "0.5", "--min-p", "0.125",
                    "--seed", "9", "hi")  # fmt: skip
    assert given.returncode == 0, given.stderr
    params = json.loads(given.stdout)["params"]
    assert [params[k] for k in (*keys, "seed")] == [0.0, 7, 0.5, 0.125, 9]
    default = run_cli(*base, "hi")
    assert default.returncode == 0, default.stderr
    params = json.loads(default.stdout)["params"]
    assert [params[k] for k in keys] == [0.8, 40, 0.95, 0.05]
    assert isinstance(params["seed"], int) and params["seed"] >= 0  # drawn, and told


def test_options_refuse_unknown_fields_and_takes_refuses_clashes() -> None:
    with pytest.raises(TypeError, match="no flag for nope"):
        Options(o.ModelOptions).only("nope")
    with pytest.raises(TypeError, match="no parameter sampling"):

        @takes(sampling=o.SamplingOptions)
        def no_place(*, load: o.ModelOptions) -> None: ...

    with pytest.raises(TypeError, match="two parameters named seed"):

        @takes(sampling=o.SamplingOptions)
        def clash(*, sampling: o.SamplingOptions, seed: int = 0) -> None: ...


def test_a_required_option_is_required(tiny_models: dict[str, Path]) -> None:
    res = run_cli("plan", "--json")
    assert res.returncode == 2 and b"Missing option '-m' / '--model'" in res.stderr
