"""Worker (torchrun, 1 rank): the VeOmni policy built from a folder with its own modeling code
(model.trust_remote_code) against transformers' forward of the same folder (trust_remote_code=True) and
against plain Qwen3 on the same weights (what a fallback would compute). Writes OUT_JSON.

    torchrun --nproc_per_node=1 tests/workers/remote_code_policy.py MODEL_DIR OUT_JSON
"""

import json
import sys

import torch

from rlcore.dist import init_distributed


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    info = init_distributed("cpu")
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    from rlcore.engine_veomni import VeOmniPolicy

    ids = torch.tensor([[1, 5, 7, 9, 11, 13, 4, 6, 8, 10]])
    labels = torch.cat([ids[:, 1:], torch.tensor([[-100]])], 1)

    def hf_logp(model):
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
        return logp.gather(1, ids[0, 1:, None])[:, 0]

    custom = hf_logp(AutoModelForCausalLM.from_pretrained(model_dir, trust_remote_code=True, dtype=torch.float32))
    plain = hf_logp(Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    policy = VeOmniPolicy(model_dir, info, dtype="float32", trainable=False, trust_remote_code=True)
    logp, _ = policy.forward_logprobs(ids, torch.arange(ids.shape[1])[None], labels, grad=False)
    veomni = logp[0, :-1].float().cpu()
    with open(out, "w") as f:
        json.dump({"class": [c.__name__ for c in type(policy.model).__mro__][:3],  # FSDP's class, then the folder's
                   "vs_custom": (veomni - custom).abs().max().item(),
                   "vs_plain_qwen3": (veomni - plain).abs().max().item()}, f)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
