"""The meter: bytes autograd holds for backward, per layer and per route, and its printed table."""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["LayerRow", "Meter", "human_bytes"]

_ROW_KEYS = ("layer", "type", "saved_bytes", "exact_bytes", "ratio", "count")


def _ratio(exact: int, saved: int) -> float:
    if saved == 0:
        return math.inf if exact else 1.0
    return exact / saved


@dataclass(frozen=True)
class LayerRow:
    """One module's line of the meter.

    Attributes:
        layer: qualified name ("" for the model itself); type: its class name.
        routes: the routes its own saves went through, in first-use order ("kept" for exact).
        saved_bytes: bytes held with compression charged to this layer; exact_bytes: bytes plain
            PyTorch holds charged to it. A storage saved by several layers is charged, held forms
            and plain bytes together, to the first layer that saved it.
        count: tensors this layer saved (shared and parameter-free ones included).

    Reads like the dict it used to be: row["saved_bytes"], {**row}, row.keys().
    """

    layer: str
    type: str
    routes: tuple[str, ...]
    saved_bytes: int
    exact_bytes: int
    count: int

    @property
    def ratio(self) -> float:
        """exact_bytes / saved_bytes (inf when nothing is held, 1.0 when nothing is charged)."""
        return _ratio(self.exact_bytes, self.saved_bytes)

    @property
    def shared(self) -> bool:
        """True when every storage this layer saved is charged to an earlier layer."""
        return self.saved_bytes == 0 and self.exact_bytes == 0

    def keys(self) -> tuple[str, ...]:
        return _ROW_KEYS

    def __getitem__(self, key: str):
        if key not in _ROW_KEYS:
            raise KeyError(key)
        return getattr(self, key)


class _Totals:
    __slots__ = ("count", "exact", "routes", "saved", "type")

    def __init__(self, type_name: str = "") -> None:
        self.type, self.routes = type_name, {}
        self.saved = self.exact = self.count = 0


class Meter:
    """Bytes autograd holds for backward, measured at pack time, per layer and per route.

    `saved_bytes` counts every saved tensor once per storage (compressed forms, masks, indices, kept
    statistics); `exact_bytes` counts what plain PyTorch would hold for the same forward (each live
    storage of a saved tensor once). Parameters and tensors derived from them are in neither. After
    the forward pass the numbers describe what autograd holds; several forwards in one block add up.
    A storage saved by several layers is charged, its plain bytes and every form held of it, to
    the first layer that saved it (so a ReLU row holds its mask and the next conv's codec copy of
    the same output; the conv row lists its route and shows "shared"). `print(meter)` shows the
    table.
    """

    def __init__(self) -> None:
        self._layers: dict[str, _Totals] = {}
        self._routes: dict[str, _Totals] = {}

    def _row(self, layer: str, type_name: str) -> _Totals:
        row = self._layers.get(layer)
        if row is None:
            row = self._layers[layer] = _Totals(type_name)
        return row

    def _cell(self, route: str) -> _Totals:
        cell = self._routes.get(route)
        if cell is None:
            cell = self._routes[route] = _Totals()
        return cell

    def _record(self, layer: str, type_name: str, route: str) -> None:
        """One tensor saved by `layer` through `route`."""
        row = self._row(layer, type_name)
        row.count += 1
        row.routes[route] = None
        self._cell(route).count += 1

    def _charge(self, layer: str, type_name: str, route: str, saved: int, exact: int) -> None:
        """Bytes held (`saved`) and plain (`exact`) charged to `layer`, held through `route`."""
        row = self._row(layer, type_name)
        row.saved += saved
        row.exact += exact
        cell = self._cell(route)
        cell.saved += saved
        cell.exact += exact

    @property
    def saved_bytes(self) -> int:
        """Bytes held for backward with compression."""
        return sum(row.saved for row in self._layers.values())

    @property
    def exact_bytes(self) -> int:
        """Bytes plain PyTorch holds for backward for the same forward."""
        return sum(row.exact for row in self._layers.values())

    @property
    def ratio(self) -> float:
        """exact_bytes / saved_bytes (inf when nothing is held, 1.0 when nothing was saved)."""
        return _ratio(self.exact_bytes, self.saved_bytes)

    def per_layer(self) -> list[LayerRow]:
        """One row per module that saved tensors, in forward order (see `LayerRow`)."""
        return [LayerRow(name, row.type, tuple(row.routes), row.saved, row.exact, row.count)
                for name, row in self._layers.items()]

    def by_route(self) -> dict[str, dict]:
        """Totals per route: the codec name, a cheap codec name, or "kept".

        Keys per route: saved_bytes, exact_bytes (plain bytes of storages first saved through it),
        ratio, count.
        """
        return {
            route: {"saved_bytes": c.saved, "exact_bytes": c.exact,
                    "ratio": _ratio(c.exact, c.saved), "count": c.count}
            for route, c in self._routes.items()
        }

    def table(self) -> str:
        """The per-layer table as text: layer, type, route(s), held, plain, ratio; a total line."""
        head = ("layer", "type", "route(s)", "held", "plain", "ratio")
        lines = [(row.layer or "(model)", row.type, ", ".join(row.routes),
                  *_sizes(row.saved_bytes, row.exact_bytes, row.shared))
                 for row in self.per_layer()]
        total = ("total", "", "", *_sizes(self.saved_bytes, self.exact_bytes, False))
        widths = [max(len(line[i]) for line in (head, *lines, total)) for i in range(len(head))]

        def fmt(cells) -> str:
            left = [c.ljust(w) for c, w in zip(cells[:3], widths)]
            right = [c.rjust(w) for c, w in zip(cells[3:], widths[3:])]
            return "  ".join(left + right).rstrip()

        rule = "-" * len(fmt(head))
        note = ("held: bytes kept for backward with compression; plain: what PyTorch alone keeps.\n"
                "A storage saved by several layers is charged (held and plain) to the first one;\n"
                "\"shared\" rows hold only such storages.")
        return "\n".join([fmt(head), rule, *map(fmt, lines), rule, fmt(total), note])

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return (f"Meter(saved_bytes={self.saved_bytes}, exact_bytes={self.exact_bytes}, "
                f"ratio={self.ratio:.2f})")


def _sizes(saved: int, exact: int, shared: bool) -> tuple[str, str, str]:
    if shared:
        return "-", "-", "shared"
    ratio = _ratio(exact, saved)
    shown = "inf" if math.isinf(ratio) else f"{ratio:.1f}x"
    return human_bytes(saved), human_bytes(exact), shown


def human_bytes(n: float) -> str:
    """A byte count rounded for reading: "512 B", "1.5 KiB", "20.3 MiB", "1.2 GiB"."""
    if n < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            break
    return f"{n:.1f} {unit}"
