"""Fixtures of the coordinator tests: a tiny BERT on disk, settings on SQLite (file) and
PostgreSQL (a fresh database per test session, dropped afterwards)."""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient
from seedfed.server.coordinator import Coordinator
from seedfed.server.runtime import Runtime
from seedfed.server.settings import Settings
from seedfed.shared.protocol.task import Hyper, LoraOptions, TaskSpec

WORDS = ["good", "bad", "great", "awful", "movie", "film", "fun", "dull", "plot", "love",
         "hate", "the", "a", "is", "was", "not", "very", "positive", "negative"]
PG_URL = os.environ.get("SEEDFED_TEST_PG", "postgresql+psycopg://postgres@127.0.0.1:5432/test")


@pytest.fixture(scope="session")
def tiny_bert(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    path = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    BertTokenizer(str(path / "vocab.txt")).save_pretrained(path)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=64, num_labels=2)
    with torch.random.fork_rng():  # the weights only need to be fixed once written
        torch.manual_seed(0)
        BertForSequenceClassification(config).save_pretrained(path)
    return path


@dataclass
class ServedTask:
    """A started app (its test `client` and runtime `rt`) serving one task (`task_id`, and
    the `join` token devices enroll with); test modules extend it with their own data."""

    client: TestClient
    rt: Runtime
    task_id: str
    join: str


def tiny_spec(model_path: Path, **over: object) -> TaskSpec:
    base: dict[str, object] = dict(
        model_path=str(model_path), num_labels=2, label_texts=("negative", "positive"),
        scope="lora", lora=LoraOptions(r=2), hyper=Hyper(lr=1e-2, eps=1e-3, steps=2,
                                                         perturbations=3, batch_size=4))
    base.update(over)
    return TaskSpec(**base)  # type: ignore[arg-type]


@pytest.fixture
def spec(tiny_bert: Path) -> TaskSpec:
    return tiny_spec(tiny_bert)


@contextlib.contextmanager
def fresh_pg_database(prefix: str) -> Iterator[tuple[str, Any, str]]:
    """A new PostgreSQL database `<prefix>_<random>`: yields (its URL, an AUTOCOMMIT engine
    on the server, its name) and drops it afterwards, connections allowed again first (a test
    may have refused them). Unreachable PostgreSQL FAILS the test."""
    import sqlalchemy as sa

    admin = sa.create_engine(PG_URL, isolation_level="AUTOCOMMIT")
    name = f"{prefix}_{secrets.token_hex(6)}"
    try:
        with admin.connect() as c:
            c.execute(sa.text(f'CREATE DATABASE "{name}"'))
    except sa.exc.OperationalError as e:
        pytest.fail(f"PostgreSQL at {PG_URL} is unreachable ({e.__class__.__name__}); the "
                    "storage contract suite must run against it (set SEEDFED_TEST_PG)")
    url = sa.engine.make_url(PG_URL).set(database=name)
    try:
        yield url.render_as_string(hide_password=False), admin, name
    finally:
        with admin.connect() as c:
            c.execute(sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))
            c.execute(sa.text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def pg_server_url() -> Iterator[str]:
    """A fresh PostgreSQL database for this test session. Unreachable PostgreSQL FAILS."""
    with fresh_pg_database("seedfed_test") as (url, _, _):
        yield url


def _reset_pg(url: str) -> None:
    import sqlalchemy as sa

    engine = sa.create_engine(url)
    with engine.begin() as c:
        c.execute(sa.text("DROP SCHEMA public CASCADE"))
        c.execute(sa.text("CREATE SCHEMA public"))
    engine.dispose()


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'coordinator.db'}"
    url: str = request.getfixturevalue("pg_server_url")
    _reset_pg(url)
    return url


@pytest.fixture
def sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'coordinator.db'}"


def make_settings(url: str, store: Path, **over: object) -> Settings:
    return Settings(database_url=url, store_dir=store, admin_token="admin-" + "x" * 20,
                    **over)  # type: ignore[arg-type]


@pytest.fixture
def settings(sqlite_url: str, tmp_path: Path) -> Settings:
    return make_settings(sqlite_url, tmp_path / "store")


@pytest.fixture
def api_settings(sqlite_url: str, tmp_path: Path) -> Settings:
    """The settings of the `client` fixture's app (a test module may override them)."""
    return make_settings(sqlite_url, tmp_path / "store", tick_interval_s=0.05)


@pytest.fixture
def client(api_settings: Settings) -> Iterator[TestClient]:
    """The coordinator's app, started (lifespan included), behind a test client."""
    from seedfed.server.app import create_app

    with TestClient(create_app(api_settings)) as c:
        yield c


@pytest.fixture
def coord(settings: Settings) -> Iterator[Coordinator]:
    c = Coordinator.open(settings)
    yield c
    c.close()
