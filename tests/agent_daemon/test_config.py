"""Configuration: flags win over DYNARL_* variables, which win over defaults; every bad setting
is named, flag and variable both."""

from __future__ import annotations

from pathlib import Path

import pytest

from agents.daemon.config import ConfigError, parse_config

BASE = {"DYNARL_URL": "http://cp.internal:8000/", "DYNARL_HOST": "gpu-7"}


def test_environment_and_defaults() -> None:
    config = parse_config(
        [],
        {
            **BASE,
            "DYNARL_BOOTSTRAP_TOKEN": "boot",
            "DYNARL_BACKEND": "ray",
            "DYNARL_BACKEND_OPTIONS": "gpus=8,hardware=H200,speed=2.5,faults=fail:switch@2",
            "DYNARL_LABELS": "rack=r3,zone=a",
            "DYNARL_STATE_DIR": "/var/lib/dynarl-agent",
            "XDG_STATE_HOME": "/ignored",
        },
    )
    assert config.url == "http://cp.internal:8000"  # no trailing slash: paths are appended
    assert (config.host, config.backend, config.bootstrap_token) == ("gpu-7", "ray", "boot")
    assert config.backend_options == {"gpus": 8, "hardware": "H200", "speed": 2.5, "faults": "fail:switch@2"}
    assert config.labels == {"rack": "r3", "zone": "a"}
    assert config.state_dir == Path("/var/lib/dynarl-agent")
    assert (config.heartbeat_interval_s, config.poll_wait_s, config.shutdown_grace_s) == (1.0, 25.0, 30.0)
    assert config.nvml and config.log_level == "INFO"


def test_flags_win_over_the_environment(tmp_path: Path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("from-file\n")
    config = parse_config(
        [
            "--url",
            "https://other:443",
            "--host",
            "gpu-8",
            "--bootstrap-token-file",
            str(token_file),
            "--backend-option",
            "gpus=2",
            "--heartbeat-interval",
            "0.5",
            "--no-nvml",
            "--log-level",
            "debug",
        ],
        {
            **BASE,
            "DYNARL_BACKEND_OPTIONS": "gpus=8",
            "DYNARL_HEARTBEAT_INTERVAL_S": "3",
            "XDG_STATE_HOME": str(tmp_path),
        },
    )
    assert (config.url, config.host, config.bootstrap_token) == ("https://other:443", "gpu-8", "from-file")
    assert config.backend_options == {"gpus": 2}
    assert config.heartbeat_interval_s == 0.5 and not config.nvml and config.log_level == "DEBUG"
    assert config.state_dir == tmp_path / "dynarl-agent"


def test_every_bad_setting_is_named() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config(
            ["--host", "-bad host", "--poll-wait", "-1", "--backend-option", "novalue"],
            {"DYNARL_URL": "ftp://x", "DYNARL_SHUTDOWN_GRACE_S": "nan", "DYNARL_LOG_LEVEL": "loud"},
        )
    named = " | ".join(caught.value.problems)
    for setting in (
        "--url / DYNARL_URL",
        "--host / DYNARL_HOST",
        "--poll-wait / DYNARL_POLL_WAIT_S",
        "--shutdown-grace / DYNARL_SHUTDOWN_GRACE_S",
        "--backend-option / DYNARL_BACKEND_OPTIONS",
        "--log-level / DYNARL_LOG_LEVEL",
    ):
        assert setting in named
    assert len(caught.value.problems) == 6


def test_backend_options_as_a_json_object() -> None:
    config = parse_config(
        [], {**BASE, "DYNARL_BACKEND_OPTIONS": '{"gpus": 8, "faults": "fail:switch,hang:barrier"}'}
    )
    assert config.backend_options == {"gpus": 8, "faults": "fail:switch,hang:barrier"}
    with pytest.raises(ConfigError, match="DYNARL_BACKEND_OPTIONS: not a JSON object"):
        parse_config([], {**BASE, "DYNARL_BACKEND_OPTIONS": "{gpus: 8}"})


def test_a_fault_drill_is_parsed_and_a_bad_one_named() -> None:
    config = parse_config(["--faults", "crash:transfer_state@1,fail:switch"], BASE)
    assert [str(f) for f in config.faults] == ["crash:transfer_state@1", "fail:switch"]
    assert parse_config([], BASE).faults == ()
    with pytest.raises(ConfigError, match="DYNARL_AGENT_FAULTS: fault 'crash:nothing'"):
        parse_config([], {**BASE, "DYNARL_AGENT_FAULTS": "crash:nothing"})


def test_a_fault_file_is_checked_at_start(tmp_path: Path) -> None:
    path = tmp_path / "faults"
    assert parse_config(["--faults-file", str(path)], BASE).faults_file == path  # may come later
    assert parse_config([], BASE).faults_file is None
    path.write_text("crash:switch@1\nhang:nothing\n")
    with pytest.raises(ConfigError, match=r"DYNARL_AGENT_FAULTS_FILE: .*unknown step kind 'nothing'"):
        parse_config([], {**BASE, "DYNARL_AGENT_FAULTS_FILE": str(path)})


def test_a_missing_url_is_refused() -> None:
    with pytest.raises(ConfigError, match="control plane's URL is required"):
        parse_config([], {"DYNARL_HOST": "gpu-7"})


def test_the_trace_directory_is_none_unless_set_and_must_be_a_directory(tmp_path: Path) -> None:
    assert parse_config([], BASE).trace_dir is None  # no trace file is read by default
    assert parse_config([], {**BASE, "DYNARL_TRACE_DIR": str(tmp_path)}).trace_dir == tmp_path
    flag = parse_config(["--trace-dir", str(tmp_path)], {**BASE, "DYNARL_TRACE_DIR": "/elsewhere"})
    assert flag.trace_dir == tmp_path
    (tmp_path / "file").write_text("")
    for missing in (tmp_path / "nowhere", tmp_path / "file"):
        with pytest.raises(ConfigError, match=r"--trace-dir / DYNARL_TRACE_DIR: .* is not a directory"):
            parse_config(["--trace-dir", str(missing)], BASE)
