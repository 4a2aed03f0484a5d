"""`decapybara settings [NAME ...]`: every server setting with its default and what it does (the launcher's "?").

The settings are `AppConfig`'s fields (decapybara/server/config.py), the one place their defaults, bounds and
descriptions live: `serve run serve_app:build_app name=value`, `decapybara serve --set name=value` (or the flag named
below where there is one) and tests take the same names. `--json` prints them as data.
"""

from __future__ import annotations

import difflib
import json
import textwrap
import typing
from typing import Any

from decapybara.errors import ConfigError


def describe(names: list[str] | None = None) -> list[dict[str, Any]]:
    """The settings (all, or `names` in their order): name, type, default, bounds, description, serve flag. A name
    that is no setting is a ConfigError naming the closest ones."""
    from decapybara.server.config import AppConfig

    flags = serve_flags()
    fields = AppConfig.model_fields
    for name in names or []:
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=3, cutoff=0.5)
            raise ConfigError(f"no setting {name!r}" + (f"; did you mean {', '.join(close)}?" if close else
                                                         "; `decapybara settings` lists them"))
    out = []
    for name in names or list(fields):
        f = fields[name]
        bounds = [f"{k} {getattr(m, k)}" for m in f.metadata for k in ("ge", "gt", "le", "lt") if hasattr(m, k)]
        out.append({"name": name, "type": _type_name(f.annotation), "default": f.default, "bounds": bounds,
                    "description": f.description or "", "flag": flags.get(name)})
    return out


def serve_flags() -> dict[str, str]:
    """Setting -> the option of `decapybara serve` that sets it (`cli_serve.FLAGS`: an option's dest is its
    flag's name)."""
    from decapybara.server import cli_serve

    return {field: "--" + flag.replace("_", "-") for flag, field in cli_serve.FLAGS.items()}


def _type_name(annotation: Any) -> str:
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(str(a) for a in args)
    if args:  # a union: its members, None last
        return " | ".join(_type_name(a) for a in sorted(args, key=lambda a: a is type(None)))
    return "none" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def add_parser(sub: Any) -> None:
    s = sub.add_parser("settings", help="every server setting: its default and what it does")
    s.add_argument("names", nargs="*", help="settings to describe (default: all)")
    s.add_argument("--json", action="store_true", help="print them as JSON")
    s.set_defaults(func=_cmd_settings)


def _cmd_settings(args: Any) -> int:
    rows = describe(args.names)
    if args.json:
        print(json.dumps(rows, indent=1, default=str))
        return 0
    for r in rows:
        default = "(none)" if r["default"] is None else json.dumps(r["default"], default=str)
        head = f"{r['name']} = {default}    [{r['type']}{', ' + ', '.join(r['bounds']) if r['bounds'] else ''}]"
        print(head + (f"    decapybara serve {r['flag']}" if r["flag"] else ""))
        for line in textwrap.wrap(r["description"], 100):
            print("    " + line)
    if not args.names:
        print("Set one: serve run serve_app:build_app NAME=VALUE ...  or  decapybara serve --set NAME=VALUE")
    return 0
