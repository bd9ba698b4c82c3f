"""Helpers for the text the commands print (the JSON they write is never shortened)."""

from __future__ import annotations

from collections.abc import Sequence

# The most items `abbreviate` prints of a list: a fused chain of thousands of nodes is one
# line of a summary, not a megabyte.
LIST_LIMIT = 12


def abbreviate(items: Sequence[str], sep: str, limit: int = LIST_LIMIT) -> str:
    """`sep`.join(items), with the middle of a list longer than `limit` replaced by a count:
    "Add -> Mul -> ... (1,234 more) -> Relu"."""
    if len(items) <= limit:
        return sep.join(items)
    head, tail = limit - limit // 3, limit // 3
    return sep.join([*items[:head], f"... ({len(items) - head - tail:,} more)", *items[len(items) - tail:]])
