"""The YAML config file (`--config FILE` or `SPECD_CONFIG`): read, and offered to the settings
as a source below the environment."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import yaml
from pydantic.fields import FieldInfo
from pydantic_settings import PydanticBaseSettingsSource

# Values read from the YAML file for the `Settings` being built (`server.config.load_settings`).
_file_values: ContextVar[dict[str, Any] | None] = ContextVar("specd_file_values", default=None)


@contextmanager
def file_values(values: dict[str, Any]) -> Iterator[None]:
    """The config file's values for the settings built inside the block."""
    token = _file_values.set(values)
    try:
        yield
    finally:
        _file_values.reset(token)


class ConfigFileSource(PydanticBaseSettingsSource):
    """The YAML config file's values, below the environment in priority."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return (_file_values.get() or {}).get(field_name), field_name, False

    def __call__(self) -> dict[str, Any]:
        return dict(_file_values.get() or {})


def read_config_file(path: str | Path) -> dict[str, Any]:
    try:
        data = yaml.safe_load(Path(path).read_text()) or {}
    except OSError as exc:
        raise ValueError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"config file {path} is not valid YAML: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"config file {path} must hold a mapping of setting names to values")
    return {str(key).replace("-", "_"): value for key, value in data.items()}
