"""Command-line options declared once, as fields of dataclasses, and turned into Typer
parameters.

An option dataclass (:mod:`specgguf.cli.options`: model loading, drafting, sampling, the
server) declares each option as a field made by :func:`option`: its default, its
:class:`Flag` (names, help, bounds) and the engine configuration arguments it sets. A
command takes a concern with :func:`takes`: the flags of the dataclass's fields become
parameters of the command's signature (Typer reads ``__signature__``), and the command
receives one instance of the dataclass, made from their values. :func:`config_args` reads
an instance back as the keyword arguments of one configuration object (``ModelConfig``,
``SpeculativeConfig``, ...). So a new option is one field: it appears on every command that
takes its concern, and reaches the configuration it names, with no other edit. This is
vLLM's ``EngineArgs`` (``add_cli_args``/``from_cli_args``) with Typer in place of argparse.

``--help`` lists a concern's flags together, in the order the dataclass declares them, at
the place of the concern's parameter in the command's signature (``GroupedCommand`` then
sorts them into their help sections).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Generic, TypeVar

import typer

T = TypeVar("T")
R = TypeVar("R")

#: The key of a field's :class:`Flag` in its ``dataclasses.field`` metadata.
FLAG = "specgguf.flag"


@dataclasses.dataclass(frozen=True)
class Flag:
    """How one field of an option dataclass appears on the command line, and what it sets.

    Args:
        names: the option's names (Typer's ``param_decls``), e.g. ``("-c", "--ctx-size")``.
        help, metavar, min, max, parser, envvar: as :func:`typer.Option` takes them.
        panel: the help section (Typer's ``rich_help_panel``; see ``GroupedCommand``).
        required: the option has no default on this command.
        to: the configuration arguments the value sets, each ``"DEST.ARGUMENT"``; DEST is
            what :func:`config_args` is asked for (``"target"``, ``"draft"``, ...).
        convert: the value as those arguments take it (None: as it is). A value that is
            or converts to None leaves the arguments out: the configuration's own default.
    """

    names: tuple[str, ...]
    help: str | None = None
    metavar: str | None = None
    min: float | None = None
    max: float | None = None
    parser: Callable[[str], Any] | None = None
    envvar: str | None = None
    panel: str | None = None
    required: bool = False
    to: tuple[str, ...] = ()
    convert: Callable[[Any], Any] | None = None


def option(
    default: Any,
    *names: str,
    help: str | None = None,
    metavar: str | None = None,
    min: float | None = None,
    max: float | None = None,
    parser: Callable[[str], Any] | None = None,
    envvar: str | None = None,
    panel: str | None = None,
    to: str | tuple[str, ...] = (),
    convert: Callable[[Any], Any] | None = None,
) -> Any:
    """A field of an option dataclass: its default, and its :class:`Flag` (see there for
    the arguments)."""
    flag = Flag(names, help=help, metavar=metavar, min=min, max=max, parser=parser,
                envvar=envvar, panel=panel, to=(to,) if isinstance(to, str) else to,
                convert=convert)  # fmt: skip
    return dataclasses.field(default=default, metadata={FLAG: flag})


def flags(cls: type) -> dict[str, Flag]:
    """The flags of an option dataclass, by field name, in the order they are declared."""
    return {f.name: f.metadata[FLAG] for f in dataclasses.fields(cls) if FLAG in f.metadata}


def config_args(options: Any, dest: str) -> dict[str, Any]:
    """The keyword arguments that an option dataclass instance gives the configuration
    object ``dest`` (the part before the dot of its fields' ``to``), converted; values that
    are None are left out."""
    args = {}
    for name, flag in flags(type(options)).items():
        for target in flag.to:
            to, _, arg = target.partition(".")
            if to == dest:
                value = getattr(options, name)
                value = flag.convert(value) if flag.convert else value
                if value is not None:
                    args[arg] = value
    return args


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """The fields' types of an option dataclass, resolved (they are strings in source)."""
    return typing.get_type_hints(cls)


class Options(Generic[T]):
    """The options of one concern as one command shows them: the fields of ``cls`` with a
    flag (all of them unless narrowed with :meth:`only` or :meth:`without`), each as
    declared or as :meth:`changed` for this command.

    Raises:
        TypeError: a field name that ``cls`` has no flag for.
    """

    def __init__(self, cls: type[T], shown: Mapping[str, Flag] | None = None) -> None:
        self.cls = cls
        self.shown = dict(flags(cls) if shown is None else shown)

    def only(self, *names: str) -> Options[T]:
        """Just these flags (the other fields keep their defaults)."""
        self._check(names)
        return Options(self.cls, {n: f for n, f in self.shown.items() if n in names})

    def without(self, *names: str) -> Options[T]:
        """All the flags but these (those fields keep their defaults)."""
        self._check(names)
        return Options(self.cls, {n: f for n, f in self.shown.items() if n not in names})

    def changed(self, name: str, **changes: Any) -> Options[T]:
        """This command's own variant of one flag: other help, bounds, or required."""
        self._check((name,))
        return Options(self.cls, {**self.shown, name: dataclasses.replace(self.shown[name],
                                                                          **changes)})  # fmt: skip

    def annotation(self, name: str) -> Any:
        """``Annotated[type, typer.Option(...)]``: the field's type and its flag, as Typer
        reads a parameter."""
        flag = self.shown[name]
        info = typer.Option(*flag.names, help=flag.help, metavar=flag.metavar, min=flag.min,
                            max=flag.max, parser=flag.parser, envvar=flag.envvar,
                            rich_help_panel=flag.panel)  # fmt: skip
        return Annotated[_hints(typing.cast(type, self.cls))[name], info]

    def parameters(self) -> list[inspect.Parameter]:
        """The flags as keyword-only parameters, with the fields' defaults."""
        defaults = {f.name: f.default for f in dataclasses.fields(self.cls)}  # type: ignore[arg-type]
        return [
            inspect.Parameter(
                name,
                inspect.Parameter.KEYWORD_ONLY,
                annotation=self.annotation(name),
                default=inspect.Parameter.empty if flag.required else defaults[name],
            )
            for name, flag in self.shown.items()
        ]

    def _check(self, names: tuple[str, ...]) -> None:
        unknown = sorted(set(names) - set(self.shown))
        if unknown:
            raise TypeError(f"{self.cls.__name__} has no flag for {', '.join(unknown)}")


def takes(**concerns: Options[Any] | type) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """A decorator: the command's parameters named by ``concerns`` become the flags of
    their option dataclass (an :class:`Options`, or a dataclass for all its flags), at the
    same place in the signature, in the order they are declared; the command is called
    with one instance of the dataclass there, made from those flags (the fields a command
    does not show keep their defaults). Every parameter of the new signature is
    keyword-only, as Typer calls commands; ``concerns`` holds the :class:`Options`.

    Raises:
        TypeError: when the command is decorated: a concern that names no parameter of the
            command, or two parameters of the same name (a flag's field and the command's
            own parameter, or two concerns').
    """
    sets = {name: c if isinstance(c, Options) else Options(c) for name, c in concerns.items()}

    def decorate(command: Callable[..., R]) -> Callable[..., R]:
        # eval_str: Typer reads __signature__ as it is, without resolving annotations.
        signature = inspect.signature(command, eval_str=True)
        missing = sorted(set(sets) - set(signature.parameters))
        if missing:
            raise TypeError(f"{command.__name__} has no parameter {', '.join(missing)}")
        params: dict[str, inspect.Parameter] = {}
        owner: dict[str, str] = {}  # a flag's parameter -> the concern it belongs to
        for p in signature.parameters.values():
            for q in sets[p.name].parameters() if p.name in sets else [p]:
                if q.name in params:
                    raise TypeError(f"{command.__name__}: two parameters named {q.name}")
                params[q.name] = q.replace(kind=inspect.Parameter.KEYWORD_ONLY)
                if p.name in sets:
                    owner[q.name] = p.name

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> R:
            values: dict[str, dict[str, Any]] = {name: {} for name in sets}
            for name, concern in owner.items():
                if name in kwargs:
                    values[concern][name] = kwargs.pop(name)
            for concern, opts in sets.items():
                kwargs[concern] = opts.cls(**values[concern])
            return command(**kwargs)

        new = signature.replace(parameters=list(params.values()))
        wrapper.__signature__ = new  # type: ignore[attr-defined]
        wrapper.concerns = sets  # type: ignore[attr-defined]  # what it takes, for tests
        # What typing.get_type_hints(wrapper) reads (Typer calls it): the new parameters.
        wrapper.__annotations__ = {
            **{p.name: p.annotation for p in new.parameters.values()},
            "return": new.return_annotation,
        }
        return wrapper

    return decorate
