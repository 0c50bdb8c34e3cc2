"""Values of verl's overrides: Hydra's value syntax read as Python, YAML flow values written back,
the row count of training files (verl's epoch length), and the one error a bad input raises."""

from __future__ import annotations

import json


class BadInput(Exception):
    """A one-paragraph reason the input cannot be converted (exit 2)."""


def parse_value(text: str):
    """A Hydra override value as Python: bool, null, int, float, list/dict (flow syntax), or str."""
    import yaml

    t = text.strip()
    if not t:
        return ""
    if len(t) >= 2 and t[0] == t[-1] and t[0] in "'\"":
        return t[1:-1]
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    if t.lower() in ("null", "none", "~"):
        return None
    for cast in (int, float):
        try:
            return cast(t)
        except ValueError:
            pass
    if t[:1] in "[{":
        try:
            value = yaml.safe_load(t)
        except yaml.YAMLError as e:
            raise BadInput(f"the value {t!r} is not a valid list or mapping ({e.problem})") from e
        return _numbers(value)
    return t


def _numbers(value):
    """yaml reads 1e-6 as a string; Hydra reads it as a float."""
    if isinstance(value, list):
        return [_numbers(v) for v in value]
    if isinstance(value, dict):
        return {k: _numbers(v) for k, v in value.items()}
    if isinstance(value, str):
        try:
            return float(value) if any(c in value.lower() for c in ".e") else value
        except ValueError:
            return value
    return value


def count_rows(files) -> int | None:
    """Rows of the training files (JSONL lines, Parquet rows via pyarrow), or None when any is unreadable."""
    files = [files] if isinstance(files, str) else list(files or [])
    total = 0
    for path in files:
        try:
            if path.endswith(".parquet"):
                import pyarrow.parquet as pq

                total += pq.read_metadata(path).num_rows
            else:
                with open(path) as f:
                    total += sum(1 for line in f if line.strip())
        except (OSError, ImportError, ValueError):
            return None
    return total if files else None


def fmt(value) -> str:
    """A YAML flow value (floats always with a '.', so every YAML loader reads them as floats)."""
    if isinstance(value, float):
        text = repr(value)
        return text if "." in text or "inf" in text or "nan" in text else text.replace("e", ".0e", 1)
    if isinstance(value, (list, tuple, dict)):
        return "{" + ", ".join(f"{k}: {fmt(v)}" for k, v in value.items()) + "}" if isinstance(value, dict) \
            else "[" + ", ".join(fmt(v) for v in value) + "]"
    return json.dumps(value)
