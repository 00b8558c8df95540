"""Coordinator settings: environment (prefix SEEDFED_), an optional TOML file, then defaults.

Precedence, highest first: keyword arguments, environment variables, the TOML file named by
SEEDFED_CONFIG (or `Settings(_toml_file=...)`), defaults. In production mode the admin token
has no default and must look random (`check_production_token`); in development a missing token
is generated at random (printed once by `seedfed coordinator`) rather than defaulted to a
well-known value. Validation errors never echo the values given (the token is one of them).
"""

from __future__ import annotations

import math
import os
import re
import secrets
from collections import Counter
from pathlib import Path
from typing import Any

from pydantic import Field, PrivateAttr, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

MIN_PRODUCTION_TOKEN = 16
#: Least entropy a production admin token must show, in bits, estimated from its own character
#: counts (`token_bits`): 64 bits is what a brute-force search must not be able to cover.
MIN_PRODUCTION_TOKEN_BITS = 64.0
#: What a bearer credential may hold (RFC 6750 b64token); anything else (spaces, control
#: characters, quotes) is a paste accident, and some clients would not send it intact.
_TOKEN68 = re.compile(r"[A-Za-z0-9._~+/-]+=*")
_TOKEN_ADVICE = ("use a random token, e.g. the output of python -c \"import secrets; "
                 "print(secrets.token_urlsafe(32))\"")


def token_bits(token: str) -> float:
    """An upper estimate of a token's entropy from its own characters: its length times the
    Shannon entropy of its character frequencies, or of the steps between neighbouring
    characters if that is lower (so runs like '0123...' score as low as repeats). Repeated,
    few or sequential characters score low ('a' * 40: 0 bits; 'admin-' + 'y' * 24: 37;
    '0123456789abcdef': 6); a random token_urlsafe(32) scores ~200."""
    n = len(token)
    if n < 2:
        return 0.0
    steps = [ord(b) - ord(a) for a, b in zip(token, token[1:], strict=False)]
    return n * min(_entropy(Counter(token).values(), n), _entropy(Counter(steps).values(), n - 1))


def _entropy(counts: Any, total: int) -> float:
    return -sum(c / total * math.log2(c / total) for c in counts)


def check_production_token(token: str | None) -> None:
    """Raise ValueError (a message without the token) unless `token` can guard production:
    present, a bearer credential's characters, at least MIN_PRODUCTION_TOKEN characters and
    MIN_PRODUCTION_TOKEN_BITS bits by `token_bits`."""
    if not token:
        raise ValueError("admin_token is required in production mode (set SEEDFED_ADMIN_TOKEN "
                         "or --admin-token)")
    if not _TOKEN68.fullmatch(token):
        raise ValueError("admin_token holds whitespace, control or other characters a bearer "
                         "token cannot carry (allowed: letters, digits and -._~+/ then '=' "
                         f"padding); {_TOKEN_ADVICE}")
    if len(token) < MIN_PRODUCTION_TOKEN:
        raise ValueError(f"admin_token must have at least {MIN_PRODUCTION_TOKEN} characters in "
                         f"production mode, got {len(token)}; {_TOKEN_ADVICE}")
    bits = token_bits(token)
    if bits < MIN_PRODUCTION_TOKEN_BITS:
        raise ValueError(f"admin_token is too guessable for production mode: its {len(token)} "
                         f"characters carry about {bits:.0f} bits (repeated or few distinct "
                         f"characters), at least {MIN_PRODUCTION_TOKEN_BITS:.0f} are needed; "
                         f"{_TOKEN_ADVICE}")


class Settings(BaseSettings):
    # hide_input_in_errors: a validation error must not print the values given (the token).
    model_config = SettingsConfigDict(env_prefix="SEEDFED_", extra="forbid",
                                      validate_default=True, hide_input_in_errors=True)

    database_url: str = "sqlite:///seedfed.db"
    store_dir: Path = Path("seedfed-store")
    admin_token: str | None = None
    production: bool = False
    host: str = "127.0.0.1"
    port: int = Field(default=8080, ge=0, le=65535)
    tls_certfile: Path | None = None
    tls_keyfile: Path | None = None
    max_body_bytes: int = Field(default=1 << 20, gt=0)
    #: Largest |scalar| accepted when the task has no clip bound (a projected gradient beyond
    #: this is a broken or hostile device, not a signal).
    scalar_hard_limit: float = Field(default=1e4, gt=0, le=1e6)  # <= wire.MAX_ABS_SCALAR
    #: Client-level DP accounting: the delta of the reported (epsilon, delta).
    dp_delta: float = Field(default=1e-5, gt=0, lt=1)
    #: How often the background ticker closes rounds past their deadline (seconds).
    tick_interval_s: float = Field(default=1.0, gt=0)
    #: Run the automatic schedule of tasks created with `schedule: auto` (the default): their
    #: next round opens as soon as the last one ended. False: every task's rounds are opened
    #: by hand (`POST .../rounds`), whatever its schedule.
    auto_open_rounds: bool = True
    #: Let anyone read task lists, status and stats (dashboards); else admin token needed.
    public_stats: bool = False
    #: Upload ingestion: most uploads committed in one transaction.
    ingest_batch: int = Field(default=256, ge=1)
    #: Master models kept in memory (least recently used beyond this are dropped).
    max_loaded_models: int = Field(default=4, ge=1)
    #: Answer uploads at the ASGI level (same code, less per-request overhead than FastAPI).
    upload_fast_path: bool = True
    #: Seconds uvicorn keeps an idle keep-alive connection (devices poll, then upload).
    keep_alive_s: float = Field(default=30.0, gt=0)
    #: A round close that fails (files, database, model loading) is retried by the ticker
    #: after close_retry_base_s, doubling per failed attempt up to close_retry_max_s.
    close_retry_base_s: float = Field(default=1.0, gt=0)
    close_retry_max_s: float = Field(default=300.0, gt=0)
    #: Devices one join token may enroll when its creator named no limit (admin routes
    #: /v1/tasks/{id}/join-tokens rotate and revoke tokens, and set per-token limits).
    max_devices_per_join_token: int = Field(default=10_000, ge=1)
    #: Seconds a connection may take to send a request's headers (from its first byte, or from
    #: the connection's opening); slower ones are dropped (slow-header attacks).
    header_timeout_s: float = Field(default=10.0, gt=0)
    #: Seconds a request body may go without a byte arriving while the coordinator waits for
    #: it; a stalled body is answered 408 and its connection closed (`server/connections.py`).
    body_timeout_s: float = Field(default=30.0, gt=0)
    #: Connections open at once that have not authenticated a request (device or admin
    #: token); a new one beyond this closes the oldest of them (`server/connections.py`).
    max_anonymous_connections: int = Field(default=1024, ge=1)
    #: Model store versions kept per task besides version 0: after the commit of version v the
    #: files of version v - keep_versions are deleted (0 keeps every version). The log is kept.
    keep_versions: int = 20
    run_migrations: bool = True
    echo_sql: bool = False

    @model_validator(mode="after")
    def _admin_token(self) -> Settings:
        if self.production:
            check_production_token(self.admin_token)
        elif not self.admin_token:
            self.admin_token = secrets.token_urlsafe(24)
            self._generated_token = True
        if (self.tls_certfile is None) != (self.tls_keyfile is None):
            raise ValueError("TLS needs both tls_certfile and tls_keyfile")
        return self

    @field_validator("keep_versions")
    @classmethod
    def _keep_versions(cls, value: int) -> int:
        if value < 0:
            raise ValueError(f"keep_versions must be >= 0 (0 keeps every version), got {value}")
        return value

    _generated_token: bool = PrivateAttr(default=False)

    @property
    def token_was_generated(self) -> bool:
        return self._generated_token

    @property
    def token(self) -> str:
        assert self.admin_token is not None  # set by the validator
        return self.admin_token

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        toml = os.environ.get("SEEDFED_CONFIG")
        sources: list[PydanticBaseSettingsSource] = [init_settings, env_settings]
        if toml:
            sources.append(TomlConfigSettingsSource(settings_cls, toml_file=Path(toml)))
        return tuple(sources)


def load_settings(toml_file: str | Path | None = None, **overrides: Any) -> Settings:
    """Settings with an explicit TOML file (overrides > env > file > defaults)."""
    if toml_file is None:
        return Settings(**overrides)
    path = Path(toml_file)
    if not path.is_file():
        raise FileNotFoundError(f"settings file {path} does not exist")
    old = os.environ.get("SEEDFED_CONFIG")
    os.environ["SEEDFED_CONFIG"] = str(path)
    try:
        return Settings(**overrides)
    finally:
        if old is None:
            os.environ.pop("SEEDFED_CONFIG", None)
        else:
            os.environ["SEEDFED_CONFIG"] = old
