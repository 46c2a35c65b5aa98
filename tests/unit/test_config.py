"""Config loading: file, overrides, and the one-line errors for bad values."""

from __future__ import annotations

import pytest

from p2ptrain.config import ConfigError, load_config

PEER = "/ip4/127.0.0.1/tcp/4001/p2p/QmSXUVsMGJFQBswMvF8D8Fmqy9QgjPzgfoqk3FUZv6ginu"


def test_defaults_are_valid():
    config = load_config()
    assert config.diloco.local_steps == 500 and config.diloco.compression == "fp16"


def test_file_then_overrides(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'run_id = "exp1"\n[swarm]\ninitial_peers = ["%s"]\n[diloco]\nlocal_steps = 50\nouter_lr = 1\n'
        '[train]\nmodel = "small"\n' % PEER
    )
    config = load_config(path, {"diloco.local_steps": 7})
    assert config.run_id == "exp1"
    assert config.swarm.initial_peers == [PEER]
    assert config.diloco.local_steps == 7  # the override wins over the file
    assert config.diloco.outer_lr == 1.0 and isinstance(config.diloco.outer_lr, float)
    assert config.train.model == "small"


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("[diloco]\nlocal_step = 5\n", "unknown setting 'diloco.local_step'"),
        ("[dilocco]\nlocal_steps = 5\n", "unknown setting 'dilocco'"),
        ("[diloco]\nlocal_steps = 'five'\n", "diloco.local_steps must be an int"),
        ("[diloco]\nlocal_steps = 0\n", "diloco.local_steps must be at least 1"),
        ("[diloco]\ncompression = 'int4'\n", "use one of: none, fp16, bf16, int8"),
        ("[train]\nmodel = 'huge'\n", "train.model 'huge' is unknown"),
        ("[swarm]\ninitial_peers = ['not-an-address']\n", "is not a multiaddr"),
        ("[swarm]\ninitial_peers = ['/ip4/127.0.0.1/tcp/4001']\n", "has no /p2p/<peer id>"),
        ("run_id = 'a.b'\n", "run_id 'a.b' must be 1-64 characters without dots"),
        (f"run_id = '{'r' * 65}'\n", "must be 1-64 characters without dots or spaces; e.g. --run-id exp1"),
        ("[diloco\n", "is not valid TOML"),
        ("[diloco]\ncompression = 'sparse'\ntarget_group_size = 4\n",
         "--compression sparse averages the whole swarm in one group: drop --target-group-size"),
        ("[diloco]\nsparse_k = 5000\n", "diloco.sparse_k must be in [1, 4097), got 5000"),
        ("[diloco]\ncompression = 'sparse'\naggregation = 'clip'\n",
         "--aggregation clip needs a butterfly codec: the sparse all-gather averages every message on every member"),
        ("[diloco]\naggregation = 'median'\n", "use one of: mean, clip, trim"),
        ("[diloco]\nreplay_rate = 1.5\n", "diloco.replay_rate 1.5 is a chance: use a number in [0, 1]"),
        ("[diloco]\nreplay_rate = 0.1\nfragments = 4\n",
         "--replay-rate replays a blocking sync's pseudo-gradients: use it with --fragments 1"),
    ],
)
def test_bad_values_name_the_setting(tmp_path, text, fragment):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert fragment in message
    assert "\n" not in message


def test_sparse_messages_stream_by_fragment(tmp_path):
    """The sparse codec runs with streaming fragments (each fragment's round sends that fragment's message)."""
    path = tmp_path / "sparse.toml"
    path.write_text("[diloco]\ncompression = 'sparse'\nlocal_steps = 12\nfragments = 3\noverlap_steps = 1\n")
    cfg = load_config(path)
    assert (cfg.diloco.compression, cfg.diloco.fragments, cfg.diloco.overlap_steps) == ("sparse", 3, 1)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")


def test_every_codec_is_selectable_from_file_and_flag(tmp_path):
    """diloco.compression and --compression accept exactly the codecs of averaging/compression.py."""
    import click
    from click.testing import CliRunner

    from p2ptrain.averaging.compression import COMPRESSION_CHOICES as COMPRESSIONS
    from p2ptrain.cli import RUN_OPTIONS, load_run_config, run_options

    assert list(COMPRESSIONS) == ["none", "fp16", "bf16", "int8", "sparse"]
    (choice,) = [kwargs["type"] for flag, _, kwargs in RUN_OPTIONS if flag == "--compression"]
    assert list(choice.choices) == list(COMPRESSIONS)

    seen = {}

    @click.command()
    @run_options(only={"diloco.compression"})
    @click.option("--config", "config_path")
    @click.pass_context
    def probe(ctx, config_path, **params):
        seen["config"] = load_run_config(ctx, config_path, params)

    for name in COMPRESSIONS:
        path = tmp_path / f"{name}.toml"
        path.write_text(f"[diloco]\ncompression = '{name}'\n")
        assert load_config(path).diloco.compression == name
        result = CliRunner().invoke(probe, ["--compression", name])
        assert result.exit_code == 0, result.output
        assert seen["config"].diloco.compression == name
    result = CliRunner().invoke(probe, ["--compression", "int3"])
    assert result.exit_code == 2 and "'int3' is not one of 'none', 'fp16', 'bf16', 'int8', 'sparse'" in result.output


def test_reachability_modes_agree_between_flag_file_and_probe(tmp_path):
    """--reachability and swarm.reachability accept exactly swarm/reachability.MODES; anything else is refused."""
    from p2ptrain.cli import RUN_OPTIONS
    from p2ptrain.swarm.reachability import MODES

    (choice,) = [kwargs["type"] for flag, _, kwargs in RUN_OPTIONS if flag == "--reachability"]
    assert list(choice.choices) == list(MODES)
    for mode in MODES:
        path = tmp_path / f"{mode}.toml"
        path.write_text(f"[swarm]\nreachability = '{mode}'\n")
        assert load_config(path).swarm.reachability == mode
    path = tmp_path / "bad.toml"
    path.write_text("[swarm]\nreachability = 'nat'\n")
    with pytest.raises(ConfigError, match="swarm.reachability 'nat' is unknown; use one of: auto, public, client"):
        load_config(path)
