"""The vision tower's training activations in the memory plan (``rlcore.plan.memory``): one
micro-batch's images through a Qwen-VL ViT, its mergers and its output, per rank."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlcore.plan.inputs import PlanInputs


def vision_activation_bytes(p: PlanInputs) -> int:
    """The vision tower's share of one micro-batch (c bytes), for an upper bound of image tokens:
    each prompt all image, t_img = micro-batch sequences x min(max_prompt_length, images per prompt
    x the processor's largest image), i.e. m^2 x t_img patches (m = spatial_merge_size).

    Trainable tower, like the decoder: with gradient checkpointing each block's input (depth x
    patches x v) plus one block recomputed with its gradients (2 x patches x block_activations),
    without it every block's saved activations plus one block's gradients; the mergers' norm
    input/output, hidden and activated values (4H per image token per merger) and the tower's
    output with its gradient (2 x t_img x output_width). A frozen tower (model.freeze_vision_tower)
    runs without autograd (no parameter or input needs a gradient), so only its output stays.
    Ulysses (U > 1, a trainable tower): a rank runs 1/U of the patches and the mergers (attending
    image by image over every rank's patches for 1/U of the heads: rlcore.engine.ulysses), and
    holds the gathered output whole.
    """
    vis = p.shape.vision
    if vis is None or p.images_per_prompt <= 0:
        return 0
    tokens = p.micro_seqs * min(p.prompt_len, p.images_per_prompt * vis.max_image_tokens)
    if p.freeze_vision:
        return tokens * vis.output_width() * p.c
    u = p.ulysses
    patches, local_tokens = -(-tokens * vis.merge ** 2 // u), -(-tokens // u)
    if p.gradient_checkpointing:
        blocks = vis.depth * patches * vis.hidden + 2 * patches * vis.block_activations()
    else:
        blocks = (vis.depth + 1) * patches * vis.block_activations()
    mergers = local_tokens * (1 + vis.deepstack) * 4 * vis.merged
    return (blocks + mergers + 2 * tokens * vis.output_width()) * p.c
