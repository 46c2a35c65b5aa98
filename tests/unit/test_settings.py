"""Each setting is declared once, as a config field: its flag, P2PTRAIN_* variable, TOML key, --help text and checks
all come from that declaration, and a bound or a choice declared there holds for a flag, a variable and a file alike."""

from __future__ import annotations

import dataclasses

import click
import pytest
from click.testing import CliRunner

from p2ptrain.config import SECTIONS, ConfigError, RunConfig, Setting, load_config, settings
from p2ptrain.keyfiles import generate_swarm_key

PEER = "/ip4/127.0.0.1/tcp/4001/p2p/QmSXUVsMGJFQBswMvF8D8Fmqy9QgjPzgfoqk3FUZv6ginu"
# valid values that are not the default, where a type's plain sample would not do
GOOD = {"swarm.initial_peers": [PEER], "swarm.host_maddrs": ["/ip4/127.0.0.1/tcp/0"],
        "swarm.announce_maddrs": ["/ip4/127.0.0.1/tcp/4001"], "train.model": "small", "train.device": "cpu",
        "diloco.inner_betas": [0.8, 0.9],
        "diloco.merge_alpha": 0.25, "diloco.replay_rate": 0.25,  # both at most 1: checked by validate
        "observe.log_to": ["tensorboard:runs"]}
# settings whose other values need a second one set (a decaying schedule needs its end): (key, value) set beside
COMPANIONS = {"diloco.lr_schedule": ("diloco.total_steps", 1000)}


def good_value(s: Setting):
    if s.key in GOOD:
        return GOOD[s.key]
    if s.choices:
        return next(c for c in reversed(s.choices) if c != s.default)
    if s.type is bool:
        return not s.default
    if s.type is str:
        return ["a", "b"] if s.many else "exp1"
    low = s.at_least if s.at_least is not None else (s.above or 0)
    value = s.type(low + 3) if s.below is None else s.type((low + s.below) / 2)
    return [value] if s.many else value


def bad_values(s: Setting):
    """One value of the setting's type per declared bound or choice, each breaking it."""
    bad = []
    if s.choices:
        bad.append("bogus")
    if s.at_least is not None:
        bad.append(s.type(s.at_least - 1))
    if s.above is not None:
        bad.append(s.type(s.above))
    if s.below is not None:
        bad.append(s.type(s.below))
    return [[v] if s.many else v for v in bad]


def as_flag_args(s: Setting, value) -> list:
    if s.type is bool:
        return [s.flag if value else f"--no-{s.flag[2:]}"]
    return [arg for item in (value if s.many else [value]) for arg in (s.flag, str(item))]


def as_env(s: Setting, value) -> str:
    return " ".join(map(str, value)) if s.many else str(value).lower() if s.type is bool else str(value)


def as_toml(s: Setting, value) -> str:
    section, _, name = s.key.rpartition(".")
    literal = repr(value).replace("True", "true").replace("False", "false")
    return (f"[{section}]\n" if section else "") + f"{name} = {literal}\n"


def probe_command(seen: dict):
    from p2ptrain.cli import load_run_config, run_options

    @click.command()
    @run_options()
    @click.option("--config", "config_path")
    @click.pass_context
    def probe(ctx, config_path, **params):
        seen["config"] = load_run_config(ctx, config_path, params)

    return probe


def value_of(config: RunConfig, s: Setting):
    section, _, name = s.key.rpartition(".")
    return getattr(getattr(config, section) if section else config, name)


def test_every_field_is_exactly_one_setting_with_its_own_flag_variable_and_key():
    fields = [f.name for f in dataclasses.fields(RunConfig) if f.name not in SECTIONS]
    fields += [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    found = settings()
    assert [s.key for s in found] == fields
    for attribute in ("flag", "env"):
        names = [getattr(s, attribute) for s in found]
        assert len(set(names)) == len(names), attribute
    assert all(s.doc for s in found), [s.key for s in found if not s.doc]


def test_join_help_names_every_flag_variable_and_default():
    from p2ptrain.cli import cli

    result = CliRunner().invoke(cli, ["join", "--help"], terminal_width=200)
    assert result.exit_code == 0, result.output
    text = " ".join(result.output.split())
    for s in settings():
        assert s.flag in text and f"env var: {s.env}" in text, s.key
        assert s.help.split(".")[0] in text, s.key


@pytest.mark.parametrize("s", settings(), ids=lambda s: s.key)
def test_a_flag_a_variable_and_a_file_set_the_same_value(s, tmp_path, monkeypatch):
    value, seen = good_value(s), {}
    if s.key == "swarm.swarm_key_file":  # the commands read the key file with their flags: it must hold a key
        value = str(tmp_path / "swarm.key")
        generate_swarm_key(value)
    assert value != s.default
    companion = [(other, v) for other in settings() for key, v in [COMPANIONS.get(s.key, (None, None))]
                 if other.key == key]
    path = tmp_path / "run.toml"
    path.write_text(as_toml(s, value) + "".join(as_toml(t, v).split("\n", 1)[1] for t, v in companion))
    assert value_of(load_config(path), s) == value
    result = CliRunner().invoke(probe_command(seen), [a for t, v in [*companion, (s, value)] for a in as_flag_args(t, v)])
    assert result.exit_code == 0, result.output
    assert value_of(seen["config"], s) == value
    for t, v in [*companion, (s, value)]:
        monkeypatch.setenv(t.env, as_env(t, v))
    result = CliRunner().invoke(probe_command(seen), [])
    assert result.exit_code == 0, result.output
    assert value_of(seen["config"], s) == value


CHECKED = [(s, bad) for s in settings() for bad in bad_values(s)]


@pytest.mark.parametrize("s, bad", CHECKED, ids=[f"{s.key}={bad}" for s, bad in CHECKED])
def test_a_declared_bound_or_choice_holds_for_a_flag_a_variable_and_a_file(s, bad, tmp_path, monkeypatch):
    path = tmp_path / "bad.toml"
    path.write_text(as_toml(s, bad))
    with pytest.raises(ConfigError) as refused:
        load_config(path)
    assert str(refused.value).startswith(s.key) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match=f"^{s.key}"):
        load_config(overrides={s.key: bad})
    result = CliRunner().invoke(probe_command({}), as_flag_args(s, bad))
    assert result.exit_code == 2 and s.flag in result.output, result.output
    monkeypatch.setenv(s.env, as_env(s, bad))
    result = CliRunner().invoke(probe_command({}), [])
    assert result.exit_code == 2 and s.flag in result.output, result.output


def test_bounds_the_flag_had_alone_now_hold_for_a_file_too(tmp_path):
    """--threads and --shard-index had click ranges that a config file went around."""
    for text, message in [("[train]\nthreads = 0\n", "train.threads must be at least 1, got 0"),
                          ("[train]\nshard_index = -1\n", "train.shard_index must be at least 0, got -1"),
                          ("[diloco]\nmatchmaking_time_s = inf\n", "diloco.matchmaking_time_s must be a finite number"),
                          ("[train]\nuntil_outer_step = 0\n", "(--max-outer-steps counts this peer's syncs instead)")]:
        path = tmp_path / "bad.toml"
        path.write_text(text)
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            load_config(path)


def test_the_light_copy_of_the_reachability_modes_agrees():
    from p2ptrain.config import REACHABILITY_MODES
    from p2ptrain.swarm.reachability import MODES

    assert tuple(REACHABILITY_MODES) == tuple(MODES)


def test_precedence_flag_over_env_over_file_over_default(tmp_path, monkeypatch):
    """file < P2PTRAIN_* variable < flag; untouched options keep the file's value."""
    seen = {}
    path = tmp_path / "run.toml"
    path.write_text("[diloco]\nlocal_steps = 50\ninner_lr = 0.01\n[train]\nbatch_size = 4\nmodel = 'small'\n")
    monkeypatch.setenv("P2PTRAIN_LOCAL_STEPS", "40")
    monkeypatch.setenv("P2PTRAIN_BATCH_SIZE", "6")
    result = CliRunner().invoke(probe_command(seen), ["--config", str(path), "--local-steps", "30"])
    assert result.exit_code == 0, result.output
    config = seen["config"]
    assert config.diloco.local_steps == 30  # flag beats variable and file
    assert config.train.batch_size == 6  # variable beats file
    assert config.diloco.inner_lr == 0.01 and config.train.model == "small"  # file beats default
    assert config.diloco.outer_lr == 0.7  # default
