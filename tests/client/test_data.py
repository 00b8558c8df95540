"""Labelled-text loading, the fixed split, the Dirichlet partitioner, batches, preference data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from seedfed.client.data import (
    DataFormatError,
    Examples,
    LabelSpace,
    MissingDataError,
    check_format,
    dirichlet_partition,
    eval_batches,
    load_labelled,
    split,
    tokenize,
    train_batches,
)
from seedfed.client.preference import preference_examples
from seedfed.shared.protocol.recipes import PREFERENCE_LABEL_TEXTS


def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


class _Tok:
    """A whitespace tokenizer with the call signature of a HF tokenizer (enough for batching)."""

    def __call__(self, texts, padding, truncation, max_length, return_tensors):  # noqa: ANN001
        import torch

        ids = [[len(w) + 1 for w in t.split()][:max_length] or [1] for t in texts]
        n = max(len(i) for i in ids)
        return {"input_ids": torch.tensor([i + [0] * (n - len(i)) for i in ids]),
                "attention_mask": torch.tensor([[1] * len(i) + [0] * (n - len(i)) for i in ids])}


def test_tsv_columns_in_either_order(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.tsv", "label\tsentence\n0\tbad film\n1\tgood film\n")
    b = _write(tmp_path / "b.tsv", "sentence\tlabel\nbad film\t0\ngood film\t1\n")

    ea, eb = load_labelled(a), load_labelled(b)

    assert ea.texts == eb.texts == ("bad film", "good film")
    assert ea.labels.tolist() == eb.labels.tolist() == [0, 1]


def test_tsv_keeps_quotes_verbatim(tmp_path: Path) -> None:
    path = _write(tmp_path / "q.tsv", 'label\tsentence\n1\tthe " best " film\n')

    assert load_labelled(path).texts == ('the " best " film',)


def test_jsonl_accepts_text_or_sentence(tmp_path: Path) -> None:
    lines = [{"label": 1, "text": "great"}, {"sentence": "awful", "label": "0"}]
    path = _write(tmp_path / "d.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")

    ex = load_labelled(path)

    assert ex.texts == ("great", "awful")
    assert ex.labels.tolist() == [1, 0]


@pytest.mark.parametrize("content, needle", [
    ("sentence\tscore\nx\t1\n", "label"),
    ("label\tbody\n1\tx\n", "text column"),
    ("label\tsentence\nyes\tx\n", "not an integer"),
    ("label\tsentence\n-1\tx\n", "negative"),
    ("label\tsentence\n", "no labelled examples"),
])
def test_bad_tsv_names_the_problem(tmp_path: Path, content: str, needle: str) -> None:
    path = _write(tmp_path / "bad.tsv", content)

    with pytest.raises(DataFormatError, match=needle):
        load_labelled(path)


def test_bad_jsonl_line_is_located(tmp_path: Path) -> None:
    path = _write(tmp_path / "bad.jsonl", '{"label": 1, "text": "ok"}\n{not json\n')

    with pytest.raises(DataFormatError, match=r"bad.jsonl:2"):
        load_labelled(path)


def test_missing_file_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        load_labelled(tmp_path / "nope.tsv")


def _examples(n: int) -> Examples:
    return Examples(tuple(f"sentence {i}" for i in range(n)), np.arange(n, dtype=np.int64) % 2)


def test_split_is_fixed_disjoint_and_complete() -> None:
    ex = _examples(500)

    s1, s2 = split(ex, validation=50, test=100), split(ex, validation=50, test=100)

    assert s1.test.texts == s2.test.texts and s1.train.texts == s2.train.texts
    parts = [set(s1.train.texts), set(s1.validation.texts), set(s1.test.texts)]
    assert [len(p) for p in parts] == [350, 50, 100]
    assert not (parts[0] & parts[1] or parts[0] & parts[2] or parts[1] & parts[2])


def test_split_drops_duplicate_texts() -> None:
    ex = Examples(("a", "A ", "b", "c", "d", "e"), np.array([0, 0, 1, 1, 0, 1]))

    s = split(ex, validation=1, test=1)

    assert len(s.train) + len(s.validation) + len(s.test) == 5


def test_split_refuses_sizes_that_leave_no_training_set() -> None:
    with pytest.raises(ValueError, match="cannot hold"):
        split(_examples(10), validation=5, test=5)


def test_dirichlet_partition_covers_every_example_once() -> None:
    labels = np.random.default_rng(0).integers(0, 3, size=1000)

    parts = dirichlet_partition(labels, 20, 0.5, np.random.default_rng(1), min_size=5)

    joined = np.concatenate(parts)
    assert sorted(joined.tolist()) == list(range(1000))
    assert min(p.size for p in parts) >= 5


def test_dirichlet_partition_is_reproducible_from_the_generator() -> None:
    labels = np.arange(400) % 2

    a = dirichlet_partition(labels, 8, 0.5, np.random.default_rng(7))
    b = dirichlet_partition(labels, 8, 0.5, np.random.default_rng(7))

    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))


def test_small_alpha_skews_labels_more_than_large_alpha() -> None:
    labels = np.arange(4000) % 2

    def mean_skew(alpha: float) -> float:
        parts = dirichlet_partition(labels, 20, alpha, np.random.default_rng(3), min_size=0)
        return float(np.mean([abs(labels[p].mean() - 0.5) for p in parts if p.size]))

    assert mean_skew(0.1) > mean_skew(100.0) + 0.1


@pytest.mark.parametrize("kwargs, needle", [
    ({"n_devices": 0, "alpha": 0.5}, "n_devices"),
    ({"n_devices": 2, "alpha": 0.0}, "alpha"),
    ({"n_devices": 200, "alpha": 0.5, "min_size": 1}, "cannot give"),
])
def test_dirichlet_partition_rejects_bad_arguments(kwargs: dict, needle: str) -> None:
    with pytest.raises(ValueError, match=needle):
        dirichlet_partition(np.arange(100) % 2, rng=np.random.default_rng(0), **kwargs)


def test_train_batches_cycle_through_every_example_per_epoch() -> None:
    ex = _examples(12)

    stream = train_batches(ex, _Tok(), 4, 16, np.random.default_rng(0))
    epoch = [next(stream) for _ in range(3)]

    seen = sorted(int(b["input_ids"][i, 1]) for b in epoch for i in range(4))
    assert seen == sorted(len(str(i)) + 1 for i in range(12))
    assert all(b["labels"].shape == (4,) for b in epoch)


def test_train_batches_depend_only_on_the_generator() -> None:
    ex = _examples(30)

    a = next(train_batches(ex, _Tok(), 8, 16, np.random.default_rng(5)))
    b = next(train_batches(ex, _Tok(), 8, 16, np.random.default_rng(5)))

    assert a["labels"].tolist() == b["labels"].tolist()
    assert a["input_ids"].tolist() == b["input_ids"].tolist()


def test_eval_batches_visit_each_example_once_in_order() -> None:
    ex = _examples(10)

    labels = [y for b in eval_batches(ex, _Tok(), 4, 16) for y in b["labels"].tolist()]

    assert labels == ex.labels.tolist()


def test_tokenize_truncates_at_max_len() -> None:
    batch = tokenize(_Tok(), ["one two three four five"], np.array([1]), max_len=3)

    assert batch["input_ids"].shape == (1, 3)


def test_preference_examples_are_balanced_and_reproducible() -> None:
    a, b = preference_examples(200, seed=4), preference_examples(200, seed=4)
    c = preference_examples(200, seed=5)

    assert a.texts == b.texts and a.labels.tolist() == b.labels.tolist()
    assert a.texts != c.texts
    assert int(a.labels.sum()) == 100
    assert len(PREFERENCE_LABEL_TEXTS) == a.num_labels == 2


# -- what a label may be, and the one-line errors that name file, line and fix ------------------
def test_label_words_of_the_task_map_to_their_index(tmp_path: Path) -> None:
    path = _write(tmp_path / "w.tsv", "label\tsentence\nIt was great!\tfine\nbad\tdull\n"
                                      "  IT WAS TERRIBLE \tawful\n")
    labels = LabelSpace.of_task(2, ("It was terrible.|bad", "It was great."))

    assert load_labelled(path, labels).labels.tolist() == [1, 0, 0]


def test_integer_labels_are_checked_against_the_tasks_range(tmp_path: Path) -> None:
    path = _write(tmp_path / "r.jsonl", '{"label": 0, "text": "a"}\n{"label": 2.0, "text": "b"}\n')

    with pytest.raises(DataFormatError, match=r"r.jsonl:2: label 2 is outside the task's 2 "):
        load_labelled(path, LabelSpace(num_labels=2))


def test_words_that_are_not_the_tasks_are_refused_with_the_accepted_ones(tmp_path: Path) -> None:
    path = _write(tmp_path / "p.tsv", "label\tsentence\npos\tgood\n")

    with pytest.raises(DataFormatError) as e:
        load_labelled(path, LabelSpace.of_task(2, ("negative", "positive")))

    assert "p.tsv:2: label 'pos' is not an integer" in str(e.value)
    assert "'negative', 'positive'" in str(e.value) and "label<TAB>sentence" in e.value.hint


def test_a_non_classifier_task_takes_any_integer_label(tmp_path: Path) -> None:
    path = _write(tmp_path / "lm.tsv", "label\ttext\n7\tsome text\n")

    assert load_labelled(path, LabelSpace.of_task(2, (), classifier=False)).labels.tolist() == [7]


def test_json_lines_are_recognized_by_their_content(tmp_path: Path) -> None:
    path = _write(tmp_path / "data.txt", '{"label": 1, "sentence": "fine"}\n')

    assert load_labelled(path).texts == ("fine",)


@pytest.mark.parametrize("content, needle, hint", [
    ("label,sentence\n0,x\n", "bad.tsv:1: the file looks comma-separated", "tab-separated"),
    ("0\tx\n1\ty\n", "bad.tsv:1: no header line", "label<TAB>sentence"),
    ("", "bad.tsv:1: the file is empty", "label<TAB>sentence"),
    ("label\tsentence\n0\n", "bad.tsv:2: expected 2 tab-separated columns, got 1",
     "label<TAB>sentence"),
])
def test_a_malformed_file_is_one_line_naming_file_line_and_fix(
        tmp_path: Path, content: str, needle: str, hint: str) -> None:
    path = tmp_path / "bad.tsv"
    path.write_bytes(content.encode())

    with pytest.raises(DataFormatError) as e:
        load_labelled(path)

    assert needle in e.value.what and hint in e.value.hint and "\n" not in str(e.value)


def test_a_file_that_is_not_text_or_not_there(tmp_path: Path) -> None:
    binary = tmp_path / "b.tsv"
    binary.write_bytes(b"\xff\xfe\x00label")

    with pytest.raises(DataFormatError, match="not UTF-8"):
        load_labelled(binary)
    with pytest.raises(MissingDataError, match="it is a directory"):
        load_labelled(tmp_path)
    assert check_format(_write(tmp_path / "any.tsv", "label\ttext\nmaybe\tx\n")) == 1
