"""MkDocs hook: the settings reference (`settings.md`), generated from the config classes.

Every field of `server.config.ServeConfig` (the engine's `EngineConfig` plus the server's
own) becomes one row: its YAML key, `PAGEDSERVE_*` variable and command-line flag (derived
as `engine.config.load_config` and `pagedserve.cli` derive them), its type, its default, and
its description: the field's `description` (what `pagedserve serve --help` prints) followed
by the comment block written right above the field in the class's source, where there is
one. Nothing here is typed
by hand, so a new setting appears on the next build.
"""

from __future__ import annotations

import inspect
import io
import sys
import tokenize
import types
import typing
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

PAGE = "settings.md"

INTRO = """\
# Settings reference

<!-- Generated at build time by docs/hooks/settings.py from engine/config.py and
server/config.py; edit those, not this page. -->

Every setting of `pagedserve serve`, generated from the config classes when the site is
built. A setting is read, lowest to highest precedence, from its field default, the YAML
file given with `--config`, the `PAGEDSERVE_<KEY>` environment variable, and the
command-line flag (see [Configuration](configuration.md)). Unknown keys, unknown
`PAGEDSERVE_*` variables (other than {non_settings}) and invalid values stop start-up
with one line naming the setting. `pagedserve serve --help` prints the same list. A
setting whose description cell is empty has no description in the code yet;
[Configuration](configuration.md) covers most of them.

"""


def on_files(files: Files, config: Any) -> Files:
    root = Path(config["config_file_path"]).parent
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    files.append(File.generated(config, PAGE, content=render()))
    return files


def render() -> str:
    from engine.config import ENV_PREFIX, NON_SETTING_VARIABLES, EngineConfig
    from server.config import DEFAULT_PRESET, ServeConfig

    engine_fields = list(EngineConfig.model_fields)
    server_fields = [name for name in ServeConfig.model_fields if name not in engine_fields]
    comments = _field_comments(EngineConfig) | _field_comments(ServeConfig)
    out = [INTRO.format(non_settings=", ".join(f"`{v}`" for v in sorted(NON_SETTING_VARIABLES)))]
    out.append("## Engine settings\n")
    out.append(
        f"`{EngineConfig.__module__}.{EngineConfig.__name__}`: "
        f"{_first_line(EngineConfig)} The offline `LLM` takes the same settings as "
        "keyword arguments.\n"
    )
    out.append(_table(ServeConfig, engine_fields, comments, ENV_PREFIX))
    out.append("## Server settings\n")
    out.append(f"`{ServeConfig.__module__}.{ServeConfig.__name__}`: {_first_line(ServeConfig)}\n")
    out.append(_table(ServeConfig, server_fields, comments, ENV_PREFIX))
    out.append("## The default preset\n")
    out.append(
        "`pagedserve serve` given neither `--config` nor a model (flag or "
        f"`{ENV_PREFIX}MODEL`) starts from these values (`DEFAULT_PRESET` in "
        "`server/config.py`, equal to `configs/default.yaml`), below the environment "
        "and the flags:\n"
    )
    out.append("| key | value |\n| --- | --- |")
    out.extend(f"| `{key}` | `{value}` |" for key, value in DEFAULT_PRESET.items())
    out.append("")
    return "\n".join(out)


def _first_line(cls: type) -> str:
    return (inspect.getdoc(cls) or "").strip().splitlines()[0]


def _table(cls: Any, names: list[str], comments: dict[str, str], prefix: str) -> str:
    rows = [
        "| key | environment variable / flag | type | default | description |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in names:
        info = cls.model_fields[name]
        flag = "--" + name.replace("_", "-")
        if info.annotation in (bool, bool | None):
            flag = f"{flag} / --no-{name.replace('_', '-')}"
        if name == "models":  # JSON in the variable; each entry a flag of its own
            flag = "--model NAME=SOURCE"
        # Both where both are written: the description is what `--help` prints, the
        # comment above the field often says more.
        parts = (info.description, comments.get(name))
        description = "<br>".join(_cell(part) for part in parts if part)
        rows.append(
            f"| `{name}` | `{prefix}{name.upper()}`<br>`{flag}` | {_type(info.annotation)} "
            f"| {_default(info)} | {description} |"
        )
    return "\n".join(rows) + "\n"


def _type(annotation: Any) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{value}`" for value in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type(arg) for arg in typing.get_args(annotation))
    if annotation is type(None):
        return "null"
    if origin is not None:
        args = ", ".join(getattr(a, "__name__", str(a)) for a in typing.get_args(annotation))
        return f"{origin.__name__}[{args}]"
    name = getattr(annotation, "__name__", str(annotation))
    return {"ByteSize": "bytes (`2GiB`, `512MB`, an integer)", "SecretStr": "secret str"}.get(
        name, name
    )


def _default(info: Any) -> str:
    value = info.default_factory() if info.default_factory is not None else info.default
    if value is None:
        return "null"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _field_comments(cls: type) -> dict[str, str]:
    """The `#` comment lines written directly above each field of `cls`'s own body."""
    source = inspect.getsource(cls)
    comments: dict[str, str] = {}
    pending: list[str] = []
    depth = None
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.INDENT and depth is None:
            depth = token.end[1]
        if token.type == tokenize.COMMENT and token.start[1] == depth:
            pending.append(token.string.lstrip("#").strip())
        elif token.type == tokenize.NAME and token.start[1] == depth:
            if pending and token.string in getattr(cls, "model_fields", {}):
                comments[token.string] = " ".join(pending)
            pending = []
        elif token.type not in (tokenize.NL, tokenize.NEWLINE) and token.start[1] == depth:
            pending = []
    return comments
