"""The command line: ``train_grpo.py --config cfg.yaml [--section.key value ...]``.

``--help`` lists every key with its meaning (the field docstrings of ``rlcore.config``) and default.
``--print_config`` prints the configuration as given (defaults, YAML and overrides merged; ``null``
and ``auto`` kept, so the file works on any device) as a commented YAML to save and edit.
``--print_resolved`` prints it after the dependent defaults are filled in for this machine's device.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import textwrap

from rlcore.config.resolve import resolve
from rlcore.config.sections import Config
from rlcore.errors import ConfigError, fail


def build_parser():
    from jsonargparse import ActionConfigFile, ArgumentParser, set_parsing_settings

    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # field docstrings -> --help
    parser = ArgumentParser(
        prog="train_grpo.py", exit_on_error=False, default_env=False,
        description="Colocated GRPO trainer: VeOmni FSDP2 policy + in-process vLLM, launched by torchrun. "
                    "--print_config prints the merged config as YAML; --print_resolved with the "
                    "device-dependent defaults filled in.",
    )
    parser.add_argument("--config", action=ActionConfigFile, help="YAML config file")
    parser.add_class_arguments(Config, nested_key=None, as_group=True)
    return parser


def parse_config(argv: list[str] | None = None, device_type: str | None = None) -> Config:
    """Parse, validate and resolve (``rlcore.config.resolve`` for ``device_type``, detected from
    ``parallel.device`` when None). A user mistake prints one paragraph and exits with code 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    show = None
    for flag in ("--print_config", "--print_resolved"):
        if flag in argv:
            argv.remove(flag)
            show = flag
    cfg = _parse(argv)
    if show == "--print_config":
        print(to_yaml(cfg), end="")
        raise SystemExit(0)
    cfg = default_output_dir(cfg, argv)
    if device_type is None:
        from rlcore.dist import detect_device

        try:
            device_type = detect_device(cfg.parallel.device)[0]
        except RuntimeError as e:
            fail(str(e))
    try:
        cfg = resolve(cfg, device_type)
    except ConfigError as e:
        fail(str(e))
    if show == "--print_resolved":
        print(f"# resolved for device {device_type}\n" + to_yaml(cfg), end="")
        raise SystemExit(0)
    return cfg


DEFAULT_RUN = "run"  # trainer.output_dir null without a --config file: outputs/run


def default_output_dir(cfg: Config, argv: list[str]) -> Config:
    """trainer.output_dir null -> outputs/<stem of the last --config file> (outputs/run without one):
    a run directory per config file, the same on every rank (it depends on the command line only)."""
    if cfg.trainer.output_dir is not None:
        return cfg
    files = [argv[i + 1] if a == "--config" else a.split("=", 1)[1] for i, a in enumerate(argv)
             if (a == "--config" and i + 1 < len(argv)) or a.startswith("--config=")]
    stem = os.path.splitext(os.path.basename(files[-1]))[0] if files else DEFAULT_RUN
    return dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, output_dir=os.path.join("outputs", stem)))


def _parse(argv: list[str]) -> Config:
    parser = build_parser()
    try:
        ns = parser.parse_args(argv)
        cfg = parser.instantiate(ns)
        return Config(**{k: getattr(cfg, k) for k in Config.__dataclass_fields__})
    except SystemExit:
        raise
    except Exception as e:  # jsonargparse wraps __post_init__ errors; show the user's part only
        fail(_clean_message(e, argv))


def to_yaml(cfg: Config) -> str:
    """The config as YAML with each section's and key's docstring as a comment above it."""
    import yaml

    lines = []
    top_docs = _field_docs(type(cfg))
    for section in dataclasses.fields(cfg):
        sub = getattr(cfg, section.name)
        if not dataclasses.is_dataclass(sub):  # a top-level list (tools)
            lines += [f"# {d}" for d in textwrap.wrap(top_docs.get(section.name, ""), 98)]
            lines.append(yaml.safe_dump({section.name: sub}, default_flow_style=True, width=10_000).strip()[1:-1])
            continue
        lines.append(f"{section.name}:  # {_one_line(type(sub).__doc__)}")
        docs = _field_docs(type(sub))
        for f in dataclasses.fields(sub):
            for doc_line in textwrap.wrap(docs.get(f.name, ""), 96):
                lines.append(f"  # {doc_line}")
            value = getattr(sub, f.name)
            value = list(value) if isinstance(value, tuple) else value
            value = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value  # rollout.multi_turn
            dumped = yaml.safe_dump({f.name: value}, default_flow_style=True, sort_keys=False, width=10_000)
            lines.append("  " + dumped.strip().removeprefix("{").removesuffix("}"))
    return "\n".join(lines) + "\n"


def _one_line(doc: str | None) -> str:
    return " ".join((doc or "").split())


# jsonargparse message -> how to fix it (its messages name the key and value, not the fix)
_PARSER_FIXES = (
    ("unrecognized arguments", "check the key's spelling; `train_grpo.py --help` lists every valid key"),
    ("does not accept option", "check the key's spelling; `train_grpo.py --help` lists every valid key"),
    ("File does not exist", "pass an existing YAML file to --config"),
    ("Expected a", "give a value of that type; `train_grpo.py --help` shows each key's type"),
    ("Does not validate", "give a value of that type; `train_grpo.py --help` shows each key's type"),
)


def _clean_message(e: Exception, argv: list[str]) -> str:
    msg = str(e).strip()
    for line in msg.splitlines():
        if "is invalid:" in line:
            return line.strip()
    one_line = " ".join(part.strip() for part in msg.splitlines() if part.strip())
    if "Problems parsing config" in msg:
        files = [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == "--config"]
        return (f"a --config file ({', '.join(files)}) is not valid YAML: "
                f"{one_line.removeprefix('Problems parsing config:').strip()}; fix its syntax")
    for pattern, fix in _PARSER_FIXES:
        if pattern in msg:
            return f"{one_line}; {fix}"
    return one_line


def _field_docs(cls) -> dict[str, str]:
    """Field name -> its docstring (the string literal under it), as jsonargparse reads them for --help."""
    import ast
    import inspect

    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
