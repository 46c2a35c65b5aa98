"""The options that set a run setting, built from config.settings() (flag, type, bounds, help, default, P2PTRAIN_*
variable: all declared once, on the config field), and the config they give; the options shared by commands; how a
bad input is reported."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import click

# light on purpose (no torch, no hivemind): every import at this level runs before --help can print
from p2ptrain.config import Setting, settings

EXIT_BAD_INPUT = 2


class BadInput(click.ClickException):
    """A user mistake: printed as one line, exit code 2."""

    exit_code = EXIT_BAD_INPUT


def _option(s: Setting) -> Tuple[str, str, Dict[str, Any]]:
    """(flag, config key, click kwargs) of a setting, all from its declaration in config.py. The option's own default
    is None: a flag or its P2PTRAIN_* variable overrides the config file only when it was actually given; --help
    shows the config field's default."""
    bounds = dict(min=s.above if s.above is not None else s.at_least, max=s.below,
                  min_open=s.above is not None, max_open=s.below is not None)
    if s.choices is not None:
        kind: Any = click.Choice(list(s.choices))
    elif s.file:
        kind = click.Path(dir_okay=False)
    elif bounds["min"] is not None or bounds["max"] is not None:
        kind = (click.IntRange if s.type is int else click.FloatRange)(**bounds)
    else:
        kind = s.type
    shown = ", ".join(map(str, s.default)) if s.many else s.default
    kwargs = dict(help=s.help, default=None, envvar=s.env, show_envvar=True,
                  show_default=str(shown) if shown not in (None, "") else False)
    if s.type is bool:
        return f"{s.flag}/--no-{s.flag[2:]}", s.key, kwargs
    return s.flag, s.key, dict(kwargs, type=kind, multiple=s.many)


RUN_OPTIONS: List[Tuple[str, str, Dict[str, Any]]] = [_option(s) for s in settings()]


def run_options(only: Optional[set] = None) -> Callable:
    """Attach the config-backed options (or the subset whose config key is in ``only``) to a command."""

    def decorate(command: Callable) -> Callable:
        for flag, key, kwargs in reversed(RUN_OPTIONS):
            if only is None or key in only:
                command = click.option(flag, key.replace(".", "__"), **kwargs)(command)
        return command

    return decorate


def overrides_from(ctx: click.Context, params: Dict[str, Any]) -> Dict[str, Any]:
    """The config settings the user actually gave, as flags or P2PTRAIN_* variables."""
    given = (click.core.ParameterSource.COMMANDLINE, click.core.ParameterSource.ENVIRONMENT)
    overrides = {}
    for _, dotted, _ in RUN_OPTIONS:
        name = dotted.replace(".", "__")
        if name in params and ctx.get_parameter_source(name) in given:
            value = params[name]
            overrides[dotted] = list(value) if isinstance(value, tuple) else value
    return overrides


def load_run_config(ctx: click.Context, config_path: Optional[str], params: Dict[str, Any]):
    from p2ptrain.config import ConfigError, load_config

    from p2ptrain.keyfiles import KeyFileError, load_swarm_key

    try:
        config = load_config(config_path, overrides_from(ctx, params))
        if config.swarm.swarm_key_file:  # before the heavy imports: a bad key file is said at once, not in 2.5 s
            load_swarm_key(config.swarm.swarm_key_file)
        return config
    except (ConfigError, KeyFileError) as e:
        raise BadInput(str(e)) from None


def draw_bars(progress: Optional[bool], stream: Any) -> bool:
    """--progress/--no-progress as given, else a bar only on a terminal: in a log file a bar is a carriage-return
    mess (one redraw per step), and the periodic log lines already tell how far training got."""
    if progress is not None:
        return progress
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # closed or replaced by an object without isatty
        return False


HEALTH_FILE_OPTION = click.option(
    "--health-file", type=click.Path(dir_okay=False), envvar="P2PTRAIN_HEALTH_FILE", show_envvar=True,
    help="Rewrite this JSON file every few seconds with what the daemon is doing; `p2ptrain health` checks it.")

