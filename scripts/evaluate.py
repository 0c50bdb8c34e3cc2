"""Score a local HF model folder on a JSONL/Parquet prompt set with vLLM: greedy accuracy (pass@1),
and mean@n / pass@n of sampled answers with --n > 1. The last line printed is JSON:
``{"accuracy": ..., "n": ...}``.

    python scripts/evaluate.py --model demo_assets/smollm2-135m-instruct --data data/arith_val.jsonl
    python scripts/evaluate.py --model outputs/smollm2_arith/hf_final --data data/arith_val.jsonl
    python scripts/evaluate.py --model outputs/demo_vl_cpu/hf_final --data demo_assets/shapes/shapes_val.jsonl \
        --image-key images --max-prompt-length 40 --max-tokens 4 --reward first_word_match
    python scripts/evaluate.py --model outputs/demo_judge_cpu/hf_final --data demo_assets/data/toy_val.jsonl \
        --max-tokens 4 --judge configs/demo_judge_cpu.yaml --reward high_digit

Prompts are rendered and scored exactly as the trainer does (rlcore.task.prompts, rlcore.task.rewards,
rlcore.step.validation). Under ``torchrun --nproc_per_node=N`` each rank scores a slice. ``--judge FILE``
adds model-based rewards (rlcore/judge): the ``reward.models`` entries of a training YAML (or a YAML
list of entries), each a component (weight 1 unless --reward names it), served by its own in-process
vLLM engine beside the model's; --samples-out then shows each judge's raw output next to its score.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from rlcore import quiet  # noqa: E402

quiet.install()  # the trainer's offline, quiet environment


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="local HF model folder")
    ap.add_argument("--data", required=True, nargs="+", help="JSONL or Parquet file(s)")
    ap.add_argument("--prompt-key", default="prompt")
    ap.add_argument("--answer-key", default=None,
                    help="row key of the reference answer (default: answer, or reward_model.ground_truth for verl's rows)")
    ap.add_argument("--image-key", default=None,
                    help="row key of the prompt's images (vision-language model), as data.image_key in training")
    ap.add_argument("--chat-template", choices=["auto", "on", "off"], default="auto",
                    help="render prompts with the tokenizer's chat template (auto: when it has one)")
    ap.add_argument("--system-prompt", default=None)
    ap.add_argument("--max-prompt-length", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64, help="max response tokens")
    ap.add_argument("--max-samples", type=int, default=0, help="first N prompts only; 0 = all")
    ap.add_argument("--n", type=int, default=1, help="> 1 adds mean@n / pass@n of sampled answers")
    ap.add_argument("--temperature", type=float, default=1.0, help="of the --n > 1 samples")
    ap.add_argument("--reward", default=None, help="components, e.g. math or math=1,format_boxed=0.2 (default: verl, "
                                                   "verl's scorer by data_source, for verl's rows; else math)")
    ap.add_argument("--reward-fn", default=None, help="custom reward package.module:function")
    ap.add_argument("--judge", default=None,
                    help="YAML with reward.models (a training config) or a list of judge entries (rlcore/judge)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--samples-out", default=None, help="write every greedy generation to this JSONL")
    return ap.parse_args(argv)


def build_configs(args):
    from rlcore.config import ConfigError, DataConfig, RewardConfig

    def fail(msg):
        print(f"error: {msg}", file=sys.stderr)
        raise SystemExit(2)

    if not os.path.isfile(os.path.join(args.model, "config.json")):
        fail(f"--model={args.model!r} is invalid: no config.json there; point it to a local HF model folder")
    from rlcore.task import verl_rows

    try:
        found = verl_rows.detect(args.data, args.prompt_key)
    except ConfigError as e:
        fail(str(e))
    components = {}
    for part in filter(None, (p.strip() for p in (args.reward or ("verl" if found else "math")).split(","))):
        name, _, weight = part.partition("=")
        components[name] = float(weight or 1.0)
    models = judge_entries(args.judge, fail) if args.judge else []
    for entry in models:  # a judge not named by --reward counts with weight 1
        if isinstance(entry, dict) and entry.get("name") and entry["name"] not in components:
            components[entry["name"]] = 1.0
    try:
        reward = RewardConfig(components=components, fn=args.reward_fn, models=models)
        data = DataConfig(prompt_key=args.prompt_key, answer_key=args.answer_key, image_key=args.image_key,
                          system_prompt=args.system_prompt, max_prompt_length=args.max_prompt_length)
    except ConfigError as e:
        fail(str(e))
    return data, reward


def judge_entries(path: str, fail) -> list:
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as e:
        fail(f"--judge={path!r} is invalid: {e}; give a training YAML with reward.models or a list of entries")
    entries = doc.get("reward", {}).get("models") if isinstance(doc, dict) else doc
    if not entries or not isinstance(entries, list):
        fail(f"--judge={path!r} holds no judge entries: give a YAML with reward.models or a list of entries")
    return entries


def main(argv=None) -> None:
    args = parse_args(argv)
    data_cfg, reward_cfg = build_configs(args)
    from rlcore.config import Config, ConfigError, ModelConfig
    from rlcore.run.preflight import load_tokenizer, load_vision
    from rlcore.task import verl_rows
    from rlcore.task.prompts import load_prompts
    from rlcore.task.rewards import Scorer

    try:
        tokenizer = load_tokenizer(args.model)
        found = verl_rows.detect(args.data, args.prompt_key)  # verl's rows: their answer key and images
        data_cfg = verl_rows.resolve_data(data_cfg, found)
        args.image_key = data_cfg.image_key  # verl's rows with images: run_eval sizes the engine for them
        # The trainer's checks: a vision-language model with its image processor, or an error here.
        processor = load_vision(Config(model=ModelConfig(path=args.model), data=data_cfg)) if data_cfg.image_key else None
        owners = [tokenizer] + ([processor.processor] if processor else [])  # VL: the template may be the processor's
        has_template = any(getattr(o, "chat_template", None) is not None for o in owners)
        data_cfg.apply_chat_template = args.chat_template == "on" or (args.chat_template == "auto" and has_template)
        prompts, stats = load_prompts(args.data, data_cfg, tokenizer, processor)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    metrics, examples = run_eval(args, prompts, tokenizer, Scorer(reward_cfg, answer_key=data_cfg.answer_key))
    if int(os.environ.get("RANK", "0")) == 0:
        report(args, metrics, examples, stats)


def run_eval(args, prompts, tokenizer, scorer):
    from rlcore.config import Config, ConfigError, DataConfig, ModelConfig, RolloutConfig, TrainerConfig, resolve
    from rlcore.dist import init_distributed
    from rlcore.judge import build_judges, shutdown
    from rlcore.metrics import Timer
    from rlcore.run.build import build_rollout
    from rlcore.run.preflight import resolve_image_limit
    from rlcore.step.switch import PhaseSwitcher
    from rlcore.step.validation import ValSettings, validate

    info = init_distributed("auto")
    # Image rows hold one placeholder per image here; vLLM expands it (load_prompts checked the
    # expanded length against --max-prompt-length).
    longest = args.max_prompt_length if args.image_key else max(len(p.ids) for p in prompts)
    # The trainer's builder and defaults for this device (dtype, sleep level, eager mode, ...).
    try:
        cfg = resolve(Config(model=ModelConfig(path=args.model), rollout=RolloutConfig(
            max_model_len=longest + args.max_tokens + 1, max_response_length=args.max_tokens,
            kv_cache_gb=args.kv_cache_gb), data=DataConfig(image_key=args.image_key, prompt_key=args.prompt_key),
            reward=scorer.cfg, trainer=TrainerConfig(seed=args.seed)), info.device_type)
    except ConfigError as e:  # a judge's folder or TP: before any engine is built
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2)
    cfg = resolve_image_limit(cfg, prompts)
    with quiet.filtered_output():
        rollout = build_rollout(cfg.model, cfg.rollout, info, seed=args.seed)
        judges = build_judges(cfg, info, rollout)  # built while the model's engine sleeps, as in training
    switch = PhaseSwitcher(None, rollout, Timer(), info.device_type, offload_params=False, offload_optimizer=False,
                           free_kv_cache=True)
    scorer.attach_judges(judges, switch.judging)
    settings = ValSettings(n=args.n, temperature=args.temperature, max_tokens=args.max_tokens,
                           max_samples=args.max_samples, num_examples=10**9, seed=args.seed)
    try:
        return validate(rollout, tokenizer, scorer, prompts, settings, wake=switch.ensure_generation)
    finally:
        import torch.distributed as dist

        shutdown(judges)
        rollout.shutdown()
        dist.destroy_process_group()


def report(args, metrics: dict, examples: list[dict], stats: dict) -> None:
    if args.samples_out:
        with open(args.samples_out, "w") as f:
            for row in examples:
                f.write(json.dumps(row) + "\n")
    for row in examples[:3]:
        print(f"--- answer {row['answer']!r} correct={row['correct']}: {row['response'][:200]!r}")
    print(json.dumps({k: round(v, 6) for k, v in {**metrics, **stats}.items()}))
    out = {"accuracy": metrics["val/accuracy"], "n": int(metrics["val/num_prompts"])}
    if args.n > 1:
        out[f"mean@{args.n}"] = metrics[f"val/mean@{args.n}"]
        out[f"pass@{args.n}"] = metrics[f"val/pass@{args.n}"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
