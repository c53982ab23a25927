"""Reading a study spec: a .toml, .json or .yaml/.yml file, or a preset shipped in
`freqact/presets/`, with the limits that make a hostile file a clear error (at most MAX_SPEC_BYTES,
safe YAML tags only, at most MAX_SPEC_NODES values with aliases counted in full). `freqact.sweep`
expands and runs what this module reads.
"""
from __future__ import annotations

import json
import os
import sys
from importlib import resources
from pathlib import Path

from freqact import checkpoint
from freqact.errors import UsageTypeError

_FORMATS = {".toml": "toml", ".json": "json", ".yaml": "yaml", ".yml": "yaml"}
MAX_SPEC_BYTES = 1 << 20
MAX_SPEC_NODES = 100_000


def presets() -> list[str]:
    """Names of the specs shipped in `freqact/presets/` (e.g. "ablation-cpu")."""
    folder = resources.files("freqact").joinpath("presets")
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_spec(spec: str | os.PathLike) -> dict:
    """Read a spec file (.toml, .json, .yaml/.yml) or a preset by name.

    Args:
        spec: a path, or a name from `presets()`.

    Returns:
        The spec as a dict; `name` defaults to the file's stem.

    Raises:
        FileNotFoundError: if `spec` is neither a file nor a preset.
        ValueError: for an unknown suffix or a file that does not parse.
    """
    path = Path(spec)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix not in _FORMATS:
            raise ValueError(f"spec: expected a {', '.join(_FORMATS)} file, got {path}")
        text, fmt = _read_spec_text(path), _FORMATS[suffix]
    elif str(spec) in presets():
        text = resources.files("freqact").joinpath("presets", f"{spec}.toml").read_text("utf-8")
        fmt = "toml"
    else:
        raise FileNotFoundError(f"spec: {spec} is neither a file nor a preset "
                                f"(presets: {', '.join(presets())})")
    raw = _parse(text, fmt, path)
    if not isinstance(raw, dict):
        raise UsageTypeError(f"spec: expected a mapping at the top of {spec}, got {type(raw).__name__}")
    return {"name": path.stem, **raw}


def _read_spec_text(path: Path) -> str:
    """A spec file's text, refused past MAX_SPEC_BYTES or when it is not UTF-8."""
    try:
        raw = checkpoint.read_bounded(path, MAX_SPEC_BYTES, "a spec (a few lines)")
    except ValueError as err:
        raise ValueError(f"spec: {err}") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"spec: {path} is not UTF-8 text ({err})") from None


def _parse(text: str, fmt: str, path: Path) -> object:
    """Parse a spec's text; every parser's error becomes a ValueError naming the file.

    YAML goes through `_bounded_yaml` (safe tags only, at most MAX_SPEC_NODES nodes counting
    each alias as the nodes it stands for); nesting too deep for the parsers is refused too.
    """
    if fmt == "yaml":
        try:
            import yaml
        except ImportError as err:
            raise ValueError(f"spec: reading {path} needs pyyaml (pip install pyyaml); "
                             "or write the spec as TOML or JSON") from err
        errors: tuple = (yaml.YAMLError,)
        parse = _bounded_yaml
    elif fmt == "json":
        errors, parse = (json.JSONDecodeError,), json.loads
    else:
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - Python 3.10
            import tomli as tomllib

        errors, parse = (tomllib.TOMLDecodeError,), tomllib.loads
    try:
        return parse(text)
    except (*errors, ValueError) as err:  # ValueError: an integer of more than 4300 digits
        raise ValueError(f"spec: {path} is not valid {fmt.upper()}: {err}") from err
    except RecursionError:
        raise ValueError(f"spec: {path} is not valid {fmt.upper()}: nested too deeply") from None


def _bounded_yaml(text: str) -> object:
    """`yaml.safe_load` that refuses documents expanding to more than MAX_SPEC_NODES nodes.

    safe_load shares an aliased node instead of copying it, so an "alias bomb" (each level
    aliasing the one before ten times) loads in microseconds but expands to billions of values
    once anything walks it (str() of the description, say). The composed node graph is sized
    with every alias counted in full (a cycle counts as unbounded) before anything is built.
    """
    import yaml

    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        size = _yaml_size(node, {})
        if size > MAX_SPEC_NODES:
            raise yaml.YAMLError(f"expands to more than {MAX_SPEC_NODES:,} values (aliases "
                                 "counted in full)")
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _yaml_size(node, sizes: dict) -> int:
    """Nodes under `node` with aliases expanded; memoised by node, capped at MAX_SPEC_NODES+1."""
    import yaml

    key = id(node)
    if key in sizes:
        return sizes[key]
    sizes[key] = MAX_SPEC_NODES + 1  # reached again while being sized: a cycle
    children = []
    if isinstance(node, yaml.SequenceNode):
        children = node.value
    elif isinstance(node, yaml.MappingNode):
        children = [part for pair in node.value for part in pair]
    size = 1
    for child in children:
        size = min(size + _yaml_size(child, sizes), MAX_SPEC_NODES + 1)
    sizes[key] = size
    return size
