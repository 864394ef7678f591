"""Where the CLI finds the server and its token: flags, then environment, then the config file.

The file is ``$DYNARL_CONFIG``, else ``$XDG_CONFIG_HOME/dynarl/config.json``, else
``~/.config/dynarl/config.json``; ``dynarl login`` writes it (readable by its owner only).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"  # where ``make run`` serves


class ConfigError(Exception):
    """The configuration is missing or unreadable: a usage problem, not an API one."""


def config_path() -> Path:
    explicit = os.environ.get("DYNARL_CONFIG")
    if explicit:
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base) / "dynarl" / "config.json"


def read_file(path: Path | None = None) -> dict[str, Any]:
    path = path or config_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a JSON object")
    return data


def write_file(values: dict[str, Any], path: Path | None = None) -> Path:
    """Write the config with mode 0600: it holds a credential."""
    path = path or config_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
        json.dump(values, handle, indent=2)
        handle.write("\n")
    os.chmod(path, 0o600)  # also when the file existed with wider permissions
    return path


@dataclass(frozen=True)
class Settings:
    url: str
    token: str | None


def resolve(url_flag: str | None, token_flag: str | None) -> Settings:
    stored = read_file()
    stored_url = str(stored.get("url") or "").rstrip("/")
    url = str(url_flag or os.environ.get("DYNARL_URL") or stored_url or DEFAULT_URL).rstrip("/")
    # The saved token belongs to the saved server: never send it to another one.
    saved_token = stored.get("token") if stored_url == url else None
    token = token_flag or os.environ.get("DYNARL_TOKEN") or saved_token or None
    return Settings(url=url, token=token)
