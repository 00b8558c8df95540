"""Hypothesis strategies shared by the wire's property tests (tests/shared) and the
coordinator's upload fuzzing (tests/server): JSON near a valid document."""

from __future__ import annotations

from hypothesis import strategies as st

#: Any JSON value, nested a little.
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=3), max_leaves=8)


def mutate_fields(draw: st.DrawFn, doc: dict[str, object], one_in: int) -> None:
    """In place: each field of `doc` dropped with chance 1/`one_in`, replaced by any JSON
    value with chance 1/`one_in`, else kept."""
    for key in list(doc):
        choice = draw(st.integers(0, one_in - 1))
        if choice == 0:
            del doc[key]
        elif choice == 1:
            doc[key] = draw(json_values)
