"""What the collectors' settings share (their models live in ``producers/<source>/config.py``)."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator
from pydantic_settings import NoDecode


def _comma_list(value: Any) -> Any:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


#: Names given comma-separated in the environment (``a, b``) or as a list by flags.
NameList = Annotated[tuple[str, ...], NoDecode, BeforeValidator(_comma_list)]
