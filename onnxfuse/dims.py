"""Symbolic dims: a dim is a size (int), a name ("batch"), a product of names and a size
("2*batch", as symbolic shape inference writes B * H), or unknown (None). Products are kept
in one spelling, the size first, then the names in code-point order, so that equal products
compare equal as strings: `canonical` spells a dim so, `product` multiplies dims.
(A dim_param with no "*" is a name, spelled as the model spells it.)"""

from __future__ import annotations

import re

Dim = int | str | None  # as onnxfuse.graph.Dim

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.:]*")


def _factors(d: int | str) -> tuple[int, list[str]] | None:
    """(size, names) of a product of sizes and names; None for any other expression."""
    if isinstance(d, int):
        return d, []
    size, names = 1, []
    for f in (x.strip() for x in d.split("*")):
        if f.isdigit():
            size *= int(f)
        elif _NAME.fullmatch(f):
            names.append(f)
        else:
            return None
    return size, names


def factors(d: Dim) -> tuple[int, list[str]] | None:
    """(size, names) of a product of sizes and names ("2*batch": (2, ["batch"])); None for an
    unknown dim or any other expression."""
    return None if d is None else _factors(d)


def _spell(size: int, names: list[str]) -> Dim:
    if not names:
        return size
    if size == 0:
        return 0
    return "*".join(([str(size)] if size != 1 else []) + sorted(names))


def canonical(d: Dim) -> Dim:
    """`d` in the one spelling of its product ("batch*2" and "2*batch" are "2*batch"); a dim
    that is not a product of sizes and names (a sum, a Min) as it is."""
    if d is None or isinstance(d, int) or "*" not in d:
        return d  # (a name stays as it is spelled)
    f = _factors(d)
    return d if f is None else _spell(*f)


def product(*dims: Dim) -> Dim:
    """The product of `dims` (None when one is unknown or not a product of sizes and names)."""
    size, names = 1, []
    for d in dims:
        f = factors(d)
        if f is None:
            return None
        size *= f[0]
        names += f[1]
    return _spell(size, names)

