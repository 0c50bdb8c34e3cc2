"""``scripts/from_verl.py``: a verl launch script (or its override list) in, this project's YAML out,
with the launch line to run it. The entry points and Hydra flags verl's scripts use are read here;
the keys are converted by rlcore.verl.convert."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

from rlcore.verl import keys as K
from rlcore.verl import rules_recipes, rules_reward, rules_run, rules_train  # noqa: F401  (they register the rules)
from rlcore.verl import script as verl_script
from rlcore.verl.convert import Converter, check_with_project_parse, to_yaml
from rlcore.verl.defaults import CONFIG_NAMES, ENGINE_CONFIGS, Defaults
from rlcore.verl.launch import classify_env, infer_device, launch_lines
from rlcore.verl.shell import ShellError
from rlcore.verl.values import BadInput, parse_value

# verl's training entry points this converter reads -> the config their Hydra main loads
ENTRIES = {"verl.trainer.main_ppo": "ppo_trainer", "verl.trainer.main_ppo_sync": "ppo_trainer",
           "recipe.dapo.main_dapo": "dapo_trainer", "recipe.partial_rollout.main_ppo": "ppo_trainer"}
# entry points that train in a way this project does not (class 3: their keys are still converted)
ENTRIES_REFUSED = {"verl.experimental.fully_async_policy.fully_async_main": "verl's fully asynchronous trainer "
                   "(rollout and training on separate devices, a stale policy): the loop here is colocated and "
                   "synchronous (rollout.partial for long responses)",
                   "verl.experimental.one_step_off_policy.main_ppo": "verl's one-step off-policy trainer: the loop "
                   "here is synchronous"}
NOT_TRAINING = ("verl.trainer.main_sft", "verl.trainer.sft_trainer", "verl.trainer.main_generation",
                "verl.trainer.main_generation_server", "verl.trainer.main_eval")


def split_overrides(argv: list[str]) -> tuple[dict, list[tuple[str, str, str]], str | None]:
    """key -> (value, as written) of the overrides (the last one wins, as in Hydra); the Hydra flags
    and group overrides as (argument, class, why); the --config-name given, if any."""
    values, flags, name, args = {}, [], None, list(argv)
    while args:
        arg = args.pop(0)
        if arg.startswith("--config-name") or arg.startswith("-cn"):
            name = (arg.split("=", 1)[1] if "=" in arg else args.pop(0) if args else "").removesuffix(".yaml")
            continue
        if arg.startswith(("--config-path", "--config-dir", "-cp", "-cd")):
            if "=" not in arg and args:
                args.pop(0)
            flags.append((arg, "no_effect", "where Hydra finds the configs: this converter carries verl's defaults "
                                            "(rlcore/verl/defaults/)"))
            continue
        if arg.startswith("-"):
            flags.append((arg, "unmapped", "a Hydra flag with no equivalent here"))
            continue
        if "=" not in arg:
            raise BadInput(f"{arg!r} is not a verl override: each argument after the entry point is key=value")
        key, text = arg.split("=", 1)
        if key.startswith("~"):
            flags.append((arg, "unmapped", "Hydra's key deletion: the key keeps verl's default meaning here"))
            continue
        if "@" in key:
            flags.append((arg, "unmapped", f"Hydra's group override: it selects verl's {text!r} config for "
                                           f"{key.split('@', 1)[1]}, whose defaults this converter does not carry"))
            continue
        key = key.lstrip("+")
        if K.lookup(key)[0] == "unknown":
            raise BadInput(f"unknown key {key!r} (in {arg!r}): {K.lookup(key)[1]}. Fix or remove the override.")
        values[key] = (parse_value(text), text)
    return values, flags, name


def pick_defaults(entry: str, name: str | None, values: dict, flags: list) -> Defaults:
    """verl's defaults for this run: --config-name's, else the entry point's; a model_engine
    override selects that engine's set, as Hydra's defaults list does."""
    config = ENTRIES.get(entry, "ppo_trainer")
    if name is not None and name in CONFIG_NAMES:
        config = name
        flags.append((f"--config-name={name}", "note", f"verl's {name} defaults apply to the keys the script leaves unset"))
    elif name is not None:
        flags.append((f"--config-name={name}", "unmapped", f"a config this converter does not carry (verl's own: "
                                                          f"{', '.join(CONFIG_NAMES)})"))
    engine = values.get("model_engine", (None,))[0]
    if engine in ENGINE_CONFIGS and not (config.startswith("dapo") and engine in ("dp", "fsdp")):
        base = ENGINE_CONFIGS[engine]
        config = config if config.startswith("dapo") and base == "ppo_trainer" else base
    return Defaults(config, {k: v for k, (v, _) in values.items()})


def read_input(args) -> tuple[list[str], str, object, object, str]:
    """The overrides, where they came from, the Shell and Runner that read the script (None for an
    argv) and the entry point."""
    if args.script is None:
        if not args.rest:
            raise BadInput("give a verl launch script, or the overrides after --")
        return args.rest, "the override list", None, None, "verl.trainer.main_ppo"
    try:
        text = open(args.script).read()
    except (OSError, UnicodeDecodeError) as e:
        raise BadInput(f"cannot read {args.script}: {e}") from e
    try:
        runner, shell = verl_script.run(text, args.rest)
    except ShellError as e:
        raise BadInput(f"{args.script}: {e}") from e
    except (ValueError, IndexError, RecursionError) as e:  # a construct the reader trips on: said, never a traceback
        raise BadInput(f"{args.script}: the shell script could not be read ({type(e).__name__}: {e})") from e
    if not runner.launches:
        raise BadInput(f"{args.script} starts no verl training: no `python3 -m verl.trainer.main_ppo` (or a recipe's "
                       "entry point) was reached" + (f" ({'; '.join(shell.notes)})" if shell.notes else ""))
    argv0, argv = runner.launches[-1]
    entry = argv0[-1]
    if entry.startswith(NOT_TRAINING):
        raise BadInput(f"{args.script} runs {entry}, not a GRPO-family trainer (verl.trainer.main_ppo, "
                       "recipe.dapo.main_dapo, ...)")
    return argv, args.script, shell, runner, entry


def convert(args) -> tuple[Converter, str, object, list]:
    overrides, source, shell, runner, entry = read_input(args)
    values, flags, name = split_overrides(overrides)
    defaults = pick_defaults(entry, name, values, flags)
    conv = Converter(values, defaults, origins=runner.sources if runner else {}, entry=entry)
    if entry in ENTRIES_REFUSED or entry not in ENTRIES:
        conv.refuse("(entry point)", ENTRIES_REFUSED.get(entry, "an entry point this converter does not know"), entry)
    elif entry != "verl.trainer.main_ppo":
        conv.note(f"{entry}: read as {ENTRIES[entry]} with its keys (the recipe's trainer loop is this project's)")
    conv.run()
    for arg, kind, why in flags:
        if kind == "unmapped":
            conv.unmapped.append((arg, "", why))
        elif kind == "no_effect":
            conv.no_effect.append((arg, "", why))
        else:
            conv.note(f"{arg}: {why}")
    check_with_project_parse(conv, source)
    return conv, source, shell, flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="from_verl.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=textwrap.fill("Turn a verl launch script (python3 -m verl.trainer.main_ppo key=value ..., DAPO's "
                    "recipe.dapo.main_dapo, also behind `ray job submit ... --`) into this project's YAML config. The "
                    "script is read, not run: its variables, ${VAR:-default}, arrays, case/if branches and the "
                    "environment decide the overrides. Every key lands in one of three classes: converted (a comment "
                    "names the verl key and value), no effect here (a comment says why), or no equivalent (exit 2 "
                    "unless --allow-unmapped). The table is docs/from_verl.md.", 100),
        epilog="examples:\n  python scripts/from_verl.py run_qwen3_8b_fsdp.sh -o qwen3_8b.yaml\n"
               "  DEVICE=npu python scripts/from_verl.py run_qwen3_8b_fsdp.sh --allow-unmapped\n"
               "  python scripts/from_verl.py -- data.train_batch_size=256 actor_rollout_ref.actor.ppo_mini_batch_size=64\n"
               "arguments after -- are the script's $@ (or, without a script, the overrides themselves).")
    p.add_argument("script", nargs="?", help="the verl launch script (a shell file)")
    p.add_argument("-o", "--output", help="write the YAML here (default: stdout)")
    p.add_argument("--allow-unmapped", action="store_true", help="write the run without the keys that have no "
                   "equivalent (listed in the YAML's header), exit 0")
    p.add_argument("--device", choices=["cuda", "npu"], help="the target device (default: trainer.device, or npu "
                   "when the script exports Ascend variables or its DEVICE is npu, else cuda)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args = build_parser().parse_args(argv[:split])
    args.rest = argv[split + 1:]
    try:
        conv, source, shell, _ = convert(args)
        exports = shell.exports if shell else {}
        device, why = infer_device(args.device, conv.v, exports, shell.scalar("DEVICE") if shell else "")
        if device == "npu":
            conv.put("parallel.device", "npu", f"the script targets Ascend NPUs ({why})", "trainer.device")
        text = to_yaml(conv, source, args.allow_unmapped)
    except BadInput as e:
        print(f"from_verl.py: error: {e}", file=sys.stderr)
        return 2
    notes = [f"from_verl.py: note: {n}" for n in (shell.notes if shell else []) + conv.notes]
    if conv.unmapped and not args.allow_unmapped:
        print("\n".join(notes + ["from_verl.py: error: these verl keys change training and have no equivalent here "
                                 "(--allow-unmapped writes the run without them and lists them in the YAML's header):"]
                        + [f"  {key}{'=' + value if value else ''}: {why}" for key, value, why in conv.unmapped]),
              file=sys.stderr)
        return 2
    if args.output:
        try:
            with open(args.output, "w") as f:
                f.write(text)
        except OSError as e:
            print(f"from_verl.py: error: cannot write {args.output}: {e}", file=sys.stderr)
            return 2
    else:
        sys.stdout.write(text)
    if notes:
        print("\n".join(notes), file=sys.stderr)
    trackers = conv.out.get("logging.trackers", ([],))[0]
    out = args.output or "OUT.yaml"
    for line in launch_lines(out, device, conv.gpus, conv.nodes, classify_env(exports), trackers):
        print(f"from_verl.py: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
