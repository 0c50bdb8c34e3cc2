"""Worker (torchrun, 1 or 2 ranks): the gradient of one optimizer step's loss for every aggregation
mode and each packing variant (``VARIANTS``: micro-batch sizes 1, 2 and 4, every position through
the LM head or only the response-predicting ones, shared-prompt packing, token-budget
micro-batches), through the real FSDP2 engine. Rank r of W trains on its contiguous share of one
fixed global batch; rank 0 saves the unsharded gradients and the policy loss summed over ranks.

The batch is two prompt groups of 3 and 5 samples with unequal response lengths, one of them a
lone EOS (a response of one token): on 2 ranks the second group is split, a partial group on each.

    torchrun --nproc_per_node=W tests/workers/grad_invariance.py MODEL_DIR OUT.pt [ulysses=U] [ep=E] [replay=1]
        [lora=R] [env=1] [vl=1] [few=1] [flash=1]

With ``ulysses`` U > 1 the ranks form Ulysses sequence-parallel groups (rlcore.engine.ulysses): each
rank still holds its own share, and the group's shares are gathered as ``grpo.train_on_batch``
gathers them (``grpo.sp_group_batch``), so every rank of a group runs 1/U of each packed row.
``ep``: expert parallelism for a MoE model. ``replay=1``: R2 routing replay, recorded by a
forward that packs one sample per row and replayed by every variant's update (packed otherwise,
so under Ulysses a token is routed on another rank than where it was recorded); the agreement
and the missing-token count are saved too. ``lora=R``: a LoRA policy of rank R (A and B seeded,
B off zero, so every adapter matrix gets a gradient). ``env=1``: multi-turn batches: two tokens in
the middle of every response of 4+ tokens are environment (tool) output, masked out of the loss
(``RolloutBatch.env_mask``) but attended to. ``vl=1`` (MODEL_DIR a Qwen3-VL folder): the second
group's prompt holds an image (the first group stays text-only, so some rows have no image: VeOmni's
dummy ViT forward), its patches sliced over a Ulysses group; the vision tower trains. ``few=1``:
only the aggregation modes of ``FEW_MODES``, a token-level and a sequence-level normaliser (the model
families' runs: the aggregation is the same code for every model, the packing variants are what
meets it). ``flash=1`` (with ``ulysses``): the policy's kernel is a flash one, so Ulysses takes
VeOmni's flash path (``rlcore.engine.ulysses.attention_for``, VeOmni's all-to-all and its call of
transformers' varlen flash with the row's ``cu_seq_lens``); the CUDA kernel is replaced by a stand-in
that attends by sdpa per segment of those ``cu_seq_lens`` (``flash_standin``), which also checks them
against the sdpa path's segments. The shared-prompt variants are left out (they need a dense mask).
"""

import gc

gc.disable()  # a short-lived worker: no automatic collections over the imports' heap (rlcore.heap)

import sys

import torch

from rlcore import advantage
from rlcore.algo import grpo
from rlcore.algo.batch import RolloutBatch
from rlcore.config import AlgorithmConfig
from rlcore.dist import all_reduce_sum, init_distributed

N, GROUP = 8, 4
FEW_MODES = ("token-mean", "seq-mean-token-sum-norm")
# name -> AlgorithmConfig fields; "full" is the reference: every position through the LM head
VARIANTS = {
    "full": dict(response_only_logits=False, micro_batch_size=4),
    **{str(m): dict(micro_batch_size=m) for m in (1, 2, 4)},
    "share/2": dict(share_prompt=True, micro_batch_size=2),
    "share/4": dict(share_prompt=True, micro_batch_size=4),
    "budget": dict(micro_batch_tokens=24),
    "share+budget": dict(share_prompt=True, micro_batch_tokens=24),
}


def global_batch(env: bool = False, vl_model: str | None = None) -> tuple[RolloutBatch, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    lo, hi = (3, 26) if vl_model is None else (9, 40)  # the VL vocabulary's 5-8 are vision tokens
    group_a, group_b = (torch.randint(lo, hi, (n,), generator=g).tolist() for n in (5, 8))
    vision = None
    if vl_model is not None:
        group_b, image = vl_prompt(vl_model, group_b)
        vision = [None] * 3 + [image] * 5
    prompts = [group_a] * 3 + [group_b] * 5
    lengths = [7, 1, 4, 9, 3, 5, 2, 8]
    responses = [torch.randint(lo, hi, (n,), generator=g).tolist() for n in lengths]
    batch = RolloutBatch(prompts, responses, [[0.0] * n for n in lengths], ["x"] * N, ["stop"] * N, GROUP,
                         vision=vision)
    if env:  # tool output inside the conversation: context, not trained
        batch.env_mask = [[0 if n >= 4 and j in (1, 2) else 1 for j in range(n)] for n in lengths]
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.2, 0.0, 1.0, 0.3, 0.0])
    return batch, rewards


def vl_prompt(model_dir: str, text: list[int]):
    """``text`` with a drawn image in the middle, expanded by the model's own processor (its
    image tokens, pixel patches and M-RoPE positions: rlcore.task.images.VisionProcessor)."""
    import random

    from rlcore.demo.vl import draw_shapes
    from rlcore.task.images import VisionProcessor

    proc = VisionProcessor(model_dir)
    image, _ = draw_shapes(random.Random(0))
    return proc.prepare(text[:4] + [proc.image_token_id] + text[4:], [image])


def count_vit_attention() -> list[int]:
    """Re-register the Ulysses ViT attention with a call counter (transformers looks the name up per call)."""
    from transformers import AttentionInterface

    from rlcore.engine import ulysses

    calls = [0]

    def counted(*args, **kwargs):
        calls[0] += 1
        return ulysses.vision_attention(*args, **kwargs)

    AttentionInterface.register(ulysses.VIT_NAME, counted)
    return calls


FLASH_SEEN = {"calls": 0, "cu_mismatch": 0}


def flash_standin(policy):
    """The flash kernel's stand-in, installed where VeOmni calls transformers' ``_flash_attention_forward``
    (veomni/ops/kernels/attention/flash.py:36-39 names the attribute for this; :278): q/k/v
    (B, S, H/U, D) after VeOmni's all-to-all, attended causally within each ``cu_seq_lens_q`` segment
    by sdpa. The engine's kernel choice is told a flash kernel exists (this stand-in is it); the
    Ulysses path it then takes is the engine's own decision."""
    from types import SimpleNamespace

    import torch.nn.functional as F
    import veomni.ops.kernels.attention.flash as veomni_flash

    import rlcore.engine_veomni as ev

    def kernel(q, k, v, attention_mask, query_length, is_causal=True, dropout=0.0, softmax_scale=None,
               cu_seq_lens_q=None, cu_seq_lens_k=None, max_length_q=None, max_length_k=None, **_):
        bounds = cu_seq_lens_q.tolist()
        want = [0] + torch.tensor([n for _, n in policy.sp.segments]).cumsum(0).tolist()
        FLASH_SEEN["calls"] += 1
        FLASH_SEEN["cu_mismatch"] += int(bounds != want or not torch.equal(cu_seq_lens_q, cu_seq_lens_k)
                                         or max_length_q != max(b - a for a, b in zip(bounds, bounds[1:])))
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (B, H, S, D)
        if k.shape[1] != q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        out = torch.cat([F.scaled_dot_product_attention(*(t[:, :, a:b] for t in (q, k, v)), is_causal=True,
                                                        scale=softmax_scale) for a, b in zip(bounds, bounds[1:])], 2)
        return out.transpose(1, 2)  # (B, S, H, D)

    def unused(*_a, **_k):
        raise RuntimeError("the stand-in replaces transformers' _flash_attention_forward: no entry point is called")

    veomni_flash._flash_attention_forward = kernel
    # what transformers' model init loads for a VeOmni flash name (flash.py:54-92, via its hub-kernel patch :94-150)
    veomni_flash._load_veomni_local_flash_kernel = lambda impl: SimpleNamespace(flash_attn_func=unused,
                                                                                 flash_attn_varlen_func=unused)
    ev.pick_attn_implementation = lambda requested, device_type, dtype=None: (
        "flash_attention_2", "a flash kernel stand-in (sdpa per cu_seq_lens segment)")


@torch.no_grad()
def grad_vector(policy, prefix: str = "") -> torch.Tensor:
    """The accumulated gradients of the engine's parameters named ``prefix*`` (all by default),
    unsharded (every rank's experts too, under EP) and flattened in parameter order (collective)."""
    from torch.distributed.tensor import DTensor

    from rlcore.engine import moe as engine_moe

    parts = []
    for name, p in policy.model.named_parameters():
        if not name.startswith(prefix):
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        g = g.full_tensor() if isinstance(g, DTensor) else g
        dim = engine_moe.ep_dim(policy.model, name)
        parts.append((g if dim is None else engine_moe.gather_ep(g, dim)).flatten().float().cpu())
    return torch.cat(parts)


def lora_policy(model_dir: str, info, rank: int, kwargs: dict):
    """A LoRA policy with seeded adapters, B moved off its zero init (the same values on every
    rank and run: a fixed seed over the whole tensor, then this rank's FSDP2 shard of it)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from rlcore.config.lora import LoraConfig
    from rlcore.engine_veomni import LoraPolicy

    policy = LoraPolicy(model_dir, info, lora=LoraConfig(rank=rank, alpha=2 * rank), **kwargs)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in policy.model.named_parameters():
            if ".lora_" in name:  # A too: the wrapper draws it from the global RNG (unseeded here)
                full = torch.randn(p.shape, generator=g) * (0.05 if ".lora_B." in name else 0.2)
                if isinstance(p, DTensor):
                    p.to_local().copy_(distribute_tensor(full, p.device_mesh, p.placements).to_local())
                else:
                    p.copy_(full)
    return policy


def main():
    model_dir, out = sys.argv[1], sys.argv[2]
    opts = {k: int(v) for k, v in (a.split("=") for a in sys.argv[3:])}
    ulysses, replay = opts.get("ulysses", 1), bool(opts.get("replay", 0))
    info = init_distributed("cpu")
    from rlcore.engine_veomni import VeOmniPolicy

    kwargs = dict(lr=1e-3, total_steps=1, ulysses_size=ulysses, ep_size=opts.get("ep", 1), routing_replay=replay)
    if opts.get("flash"):
        holder = type("Holder", (), {})()
        flash_standin(holder)
    if opts.get("lora"):
        policy = lora_policy(model_dir, info, opts["lora"], kwargs)
    else:
        policy = VeOmniPolicy(model_dir, info, **kwargs)
    if opts.get("flash"):
        holder.sp = policy.sp
        assert policy.attn_implementation == "flash_attention_2" and policy.sp.flash, policy.attn_reason
    batch, rewards = global_batch(bool(opts.get("env", 0)), model_dir if opts.get("vl") else None)
    vit_calls = count_vit_attention() if opts.get("vl") and ulysses > 1 else None
    adv = advantage.compute_advantages("grpo", rewards, batch.response_mask(), GROUP)  # (N, T) global
    # Old/ref log-probs off the current ones, so clipping, dual clip and KL are all active.
    cur = grpo.compute_logprobs_in_chunks(policy, batch, 0.9, N, info.device, shared=True)  # the same everywhere
    noise = torch.randn(cur.shape, generator=torch.Generator().manual_seed(1))
    old, ref = cur + 0.3 * noise * batch.response_mask(), cur - 0.2 * noise.abs() * batch.response_mask()
    per = N // info.world_size
    mine = list(range(info.rank * per, (info.rank + 1) * per))
    local, (l_adv, l_old, l_ref), _ = grpo.sp_group_batch(policy, batch.select(mine), adv[mine], old[mine], ref[mine])
    routing = {"routing_replay": "r2", "mini_batches": 2} if replay else {}  # r2 wants a later forward
    if replay:  # one sample per row: every later packing slices the rows elsewhere
        with policy.routing("record"):
            grpo.compute_logprobs_in_chunks(policy, local, 0.9, AlgorithmConfig(micro_batch_size=1, **routing),
                                            info.device, shared=True)
    results = {}
    for mode in FEW_MODES if opts.get("few") else advantage.AGG_MODES:
        for loss in ("vanilla", "gspo"):
            for name, fields in VARIANTS.items():
                if opts.get("flash") and fields.get("share_prompt"):
                    continue
                cfg = AlgorithmConfig(loss_agg_mode=mode, policy_loss=loss, kl_loss_coef=0.1, entropy_coef=0.01,
                                      clip_high=0.28, **fields, **routing)
                for opt in policy._inner_optimizers():  # one AdamW per mesh under EP
                    opt.zero_grad(set_to_none=True)
                inp = grpo.UpdateInputs(l_adv, l_old, l_ref, torch.zeros_like(l_old), local.response_mask(), 0.9,
                                        info.world_size, norm_len=10)
                sums = {}
                with policy.routing("replay" if replay else None):
                    grpo.accumulate_gradients(policy, local, list(range(len(local))), inp, cfg, sums)
                results[f"{mode}/{loss}/{name}"] = grad_vector(policy)
                # the policy loss summed over ranks: each rank's share of it with data parallelism,
                # the group's whole batch over U x the counts under Ulysses: the same number
                results[f"{mode}/{loss}/{name}/loss"] = torch.tensor(all_reduce_sum([sums["actor/pg_loss"]]))
                if opts.get("vl") and name == "full":  # the vision tower's part: it trains too
                    results[f"{mode}/{loss}/{name}/vision"] = grad_vector(policy, "model.visual.")
    if replay:  # over every variant's update
        results.update({k: torch.tensor(float(v)) for k, v in policy.routing_metrics().items() if k.startswith("actor/")})
    if vit_calls is not None:  # the ViT blocks attended through the Ulysses ViT attention
        results["sp/vit_calls"] = torch.tensor(float(vit_calls[0]))
    if opts.get("flash"):
        results["flash/calls"] = torch.tensor(float(FLASH_SEEN["calls"]))
        results["flash/cu_mismatch"] = torch.tensor(float(FLASH_SEEN["cu_mismatch"]))
    if policy.sp is not None:  # the Ulysses path really ran: rows sliced, padding counted
        results["sp/row_tokens"] = torch.tensor(float(policy.sp.row_tokens))
        results["sp/pad_tokens"] = torch.tensor(float(policy.sp.pad_tokens))
    if info.rank == 0:
        torch.save(results, out)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    from rlcore.dist import run_then_exit

    run_then_exit(main)
