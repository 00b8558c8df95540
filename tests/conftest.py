import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# simulations share encoded features across runs (seedfed.features): within this session only
if "SEEDFED_FEATURE_CACHE" not in os.environ:
    import atexit
    import shutil
    import tempfile

    os.environ["SEEDFED_FEATURE_CACHE"] = tempfile.mkdtemp(prefix="seedfed-features-")
    atexit.register(shutil.rmtree, os.environ["SEEDFED_FEATURE_CACHE"], True)


# --- fixtures shared by the fleet tests (Flower apps, HTTP device) -----------------------------


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matrices on a shared 2-core machine: extra intra-op threads only spin."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fleet_assets(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny BERT model directory and a labelled TSV, built once per test module."""
    from tests.fleet_helpers import make_tiny_bert, write_sentiment_tsv

    root = tmp_path_factory.mktemp("fleet")
    return make_tiny_bert(root / "model"), write_sentiment_tsv(root / "data.tsv")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Llama causal LM with a character tokenizer (ternary tasks on devices)."""
    from tests.fleet_helpers import write_tiny_llama

    return write_tiny_llama(tmp_path_factory.mktemp("llama") / "model", tokenizer=True)
