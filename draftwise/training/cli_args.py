"""Command-line options generated from a training config dataclass: one `--field-name` per field,
typed from its annotation, so `draftwise train ...` and the config classes never drift apart."""
from __future__ import annotations

import argparse
import dataclasses


def _scalar_type(annotation: str):
    base = annotation.replace(" | None", "").replace("None | ", "").strip()
    return {"int": int, "float": float, "str": str}.get(base, str)


def add_dataclass_args(p: argparse.ArgumentParser, cls, defaults: dict | None = None):
    """Fields without a default (and not given one in `defaults`) become required options."""
    defaults = defaults or {}
    for f in dataclasses.fields(cls):
        name = "--" + f.name.replace("_", "-")
        ann = str(f.type)
        default = defaults.get(f.name, f.default)
        if default is dataclasses.MISSING:
            p.add_argument(name, required=True, dest=f.name)
        elif ann.startswith(("list[int]", "tuple[int")):
            p.add_argument(name, type=int, nargs="+", default=default, dest=f.name)
        elif ann == "bool":
            p.add_argument(name, action=argparse.BooleanOptionalAction, default=default, dest=f.name)
        else:
            p.add_argument(name, type=_scalar_type(ann), default=default, dest=f.name)
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p


def config_from_args(cls, args):
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
