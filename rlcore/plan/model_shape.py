"""The model's shape for the memory plan: what ``rlcore.plan.memory`` reads from a model folder.

``ModelShape`` is the decoder of a ``config.json`` (dense Llama/Qwen-style and Qwen-MoE: hidden size,
layers, heads, MLP or routed experts, vocab, tied lm_head) with its parameter counts (the FSDP root,
per layer, per expert-parallel rank, the largest weight-sync unit) and the activation elements a
layer saves per token. ``VisionShape`` is the vision tower of a vision-language model (Qwen3-VL,
Qwen3-VL-MoE, Qwen2.5-VL, Qwen2-VL: ``vision_config``) with its parameters and activations per
patch; ``max_image_tokens`` reads the image budget of the folder's processor config
(``preprocessor_config.json`` or ``processor_config.json``). Pure arithmetic on those JSON files,
no weights. Notation as in ``rlcore.plan.memory``: h hidden size, V vocab, P parameters.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from rlcore.hf_folder import read_config

# The processors' default image budget: Qwen2-VL 12,845,056 pixels / 28^2, Qwen3-VL 16,777,216 / 32^2
# (max_pixels / (patch x merge)^2); preprocessor_config.json in the model folder may lower it.
DEFAULT_MAX_IMAGE_TOKENS = 16384
VISION_FAMILIES = {"qwen3_vl": "qwen3_vl", "qwen3_vl_moe": "qwen3_vl", "qwen2_5_vl": "qwen2_5_vl",
                   "qwen2_vl": "qwen2_vl"}  # config.json model_type -> vision tower layout


@dataclass(frozen=True)
class VisionShape:
    """The vision tower (``model.visual``) of a Qwen-VL ``config.json``: ``vision_config`` read with
    transformers' defaults (transformers 5.19, models/qwen*_vl/configuration_qwen*_vl.py). Layouts
    (v hidden, I intermediate, H = v x merge^2 the merged width, o out_hidden_size = the LM's h):

    - qwen3_vl (Qwen3-VL, Qwen3-VL-MoE): Conv3d patch embedding with bias, learned position
      embedding (num_position_embeddings x v), blocks of LayerNorm / qkv / proj / GELU MLP (all with
      bias), a merger (LayerNorm over v, H -> H -> o) and one deepstack merger per
      ``deepstack_visual_indexes`` entry (LayerNorm over H, H -> H -> o);
    - qwen2_5_vl: patch embedding without bias, no position embedding, RMSNorm blocks with a gated
      (SwiGLU) MLP with bias, merger with an RMSNorm over v;
    - qwen2_vl: like qwen2_5_vl but LayerNorm and a plain MLP of ``embed_dim x mlp_ratio``; its
      ``hidden_size`` is the output width and ``embed_dim`` the tower's.
    """

    family: str
    depth: int
    hidden: int
    intermediate: int
    out_hidden: int
    merge: int
    patch_pixels: int  # in_channels x temporal_patch_size x patch_size^2: one patch's values
    pos_embeddings: int = 0
    deepstack: int = 0
    max_image_tokens: int = DEFAULT_MAX_IMAGE_TOKENS  # the processor's max_pixels / (patch x merge)^2

    @classmethod
    def from_hf_config(cls, c: dict, max_image_tokens: int | None = None) -> "VisionShape | None":
        """None for a config without ``vision_config``, or whose tower layout the plan does not
        know (``ModelShape.from_path`` then warns that it is not counted)."""
        v = c.get("vision_config")
        family = VISION_FAMILIES.get(c.get("model_type", ""))
        if v is None or family is None:
            return None
        size = {"qwen3_vl": (27, 1152, 4304, 3584, 16), "qwen2_5_vl": (32, 3584, 3420, 3584, 14)}
        if family == "qwen2_vl":
            hidden = v.get("embed_dim", 1280)
            depth, inter, out, patch = v.get("depth", 32), int(hidden * v.get("mlp_ratio", 4)), \
                v.get("hidden_size", 3584), v.get("patch_size", 14)
        else:
            d_depth, d_hidden, d_inter, d_out, d_patch = size[family]
            depth, hidden, inter = v.get("depth", d_depth), v.get("hidden_size", d_hidden), \
                v.get("intermediate_size", d_inter)
            out, patch = v.get("out_hidden_size", d_out), v.get("patch_size", d_patch)
        channels = v.get("in_channels", v.get("in_chans", 3))
        qwen3 = family == "qwen3_vl"
        return cls(family=family, depth=depth, hidden=hidden, intermediate=inter, out_hidden=out,
                   merge=v.get("spatial_merge_size", 2),
                   patch_pixels=channels * v.get("temporal_patch_size", 2) * patch * patch,
                   pos_embeddings=v.get("num_position_embeddings", 2304) if qwen3 else 0,
                   deepstack=len(v.get("deepstack_visual_indexes", (8, 16, 24))) if qwen3 else 0,
                   max_image_tokens=max_image_tokens or DEFAULT_MAX_IMAGE_TOKENS)

    @property
    def merged(self) -> int:
        """H: the width of merge x merge patches concatenated (the mergers' input)."""
        return self.hidden * self.merge ** 2

    def patch_embed(self) -> int:
        return self.patch_pixels * self.hidden + self.hidden * (self.family == "qwen3_vl")

    def pos_embed(self) -> int:
        return self.pos_embeddings * self.hidden

    def block(self) -> int:
        """One ViT block: two norms, qkv and proj (with bias), the MLP (with bias)."""
        v, i = self.hidden, self.intermediate
        norms = 2 * v if self.family == "qwen2_5_vl" else 4 * v  # RMSNorm weight / LayerNorm weight + bias
        mlp = 3 * v * i + 2 * i + v if self.family == "qwen2_5_vl" else 2 * v * i + i + v
        return norms + 3 * v * v + 3 * v + v * v + v + mlp

    def merger(self, norm_width: int) -> int:
        """A patch merger: a norm over ``norm_width`` (LayerNorm: weight + bias; Qwen2.5-VL's RMSNorm:
        weight), then H -> H and H -> o linears with bias."""
        h, o = self.merged, self.out_hidden
        norm = norm_width * (1 if self.family == "qwen2_5_vl" else 2)
        return norm + h * h + h + h * o + o

    def root(self) -> int:
        """What FSDP2 leaves in the root unit: VeOmni wraps each ViT block (``_no_split_modules``:
        Qwen3VLVisionBlock), so the patch and position embeddings and the mergers stay at the root."""
        return (self.patch_embed() + self.pos_embed() + self.merger(self.hidden)
                + self.deepstack * self.merger(self.merged))

    @property
    def params(self) -> int:
        return self.root() + self.depth * self.block()

    def replicated(self) -> int:
        """Parameters vLLM does not shard by tensor parallelism (its Conv3d patch embedding and
        nn.Embedding position embedding; qkv, proj, MLP and mergers are column/row parallel)."""
        return self.patch_embed() + self.pos_embed()

    def block_activations(self) -> int:
        """Elements per patch a ViT block saves for backward, as ``ModelShape.layer_activations``
        counts them: both norms' inputs and outputs (4v), qkv before and after RoPE (6v), the
        attention output (v), the MLP's hidden and activated values (2I; 3I gated)."""
        mlp = 3 * self.intermediate if self.family == "qwen2_5_vl" else 2 * self.intermediate
        return 11 * self.hidden + mlp

    def output_width(self) -> int:
        """Elements per image token the tower returns: the merger's o plus one o per deepstack merger."""
        return self.out_hidden * (1 + self.deepstack)


def max_image_tokens(model_path: str, vision_config: dict) -> int | None:
    """Image tokens of the largest image the folder's image processor admits: its ``max_pixels``
    (or ``size.longest_edge``) over (patch x merge)^2. The processor is ``preprocessor_config.json``
    (released checkpoints) or the ``image_processor`` of ``processor_config.json`` (transformers 5's
    save_pretrained); None without either (the processors' default, ``DEFAULT_MAX_IMAGE_TOKENS``)."""
    for name, key in (("preprocessor_config.json", None), ("processor_config.json", "image_processor")):
        try:
            with open(os.path.join(model_path, name)) as f:
                pre = json.load(f)
        except (OSError, ValueError):
            continue
        pre = pre.get(key) if key else pre
        pixels = isinstance(pre, dict) and ((pre.get("size") or {}).get("longest_edge") or pre.get("max_pixels"))
        if pixels:
            unit = (pre.get("patch_size") or vision_config.get("patch_size", 16)) * \
                (pre.get("merge_size") or vision_config.get("spatial_merge_size", 2))
            return max(1, int(pixels) // unit ** 2)
    return None


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs from config.json: dense Llama/Qwen-style and Qwen-MoE decoders, and the
    vision tower of Qwen-VL models (``vision``; the decoder is their ``text_config``)."""

    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    experts: int = 0
    experts_per_tok: int = 0
    moe_intermediate: int = 0
    shared_intermediate: int = 0  # Qwen2-MoE shared expert (0 for Qwen3-MoE)
    sparse: tuple[bool, ...] = ()  # per layer: routed experts instead of the dense MLP
    vision: VisionShape | None = None  # a vision-language model's ViT and mergers
    uncounted_vision: str = ""  # model_type of a vision tower the plan cannot count (a warning)

    @classmethod
    def from_hf_config(cls, c: dict) -> "ModelShape":
        from rlcore.hf_folder import num_experts

        mtype, layers = c.get("model_type", ""), c["num_hidden_layers"]
        experts = num_experts(c)
        step, dense_only = c.get("decoder_sparse_step", 1) or 1, set(c.get("mlp_only_layers") or [])
        sparse = tuple(experts > 0 and i not in dense_only and (i + 1) % step == 0 for i in range(layers))
        heads = c["num_attention_heads"]
        return cls(
            arch=(c.get("architectures") or [mtype])[0], hidden=c["hidden_size"], layers=layers, heads=heads,
            kv_heads=c.get("num_key_value_heads") or heads,
            head_dim=c.get("head_dim") or c["hidden_size"] // heads,
            intermediate=c.get("intermediate_size", 0), vocab=c["vocab_size"],
            tied=bool(c.get("tie_word_embeddings", False)),
            qkv_bias=bool(c.get("attention_bias", mtype.startswith("qwen2"))),  # Qwen2, -MoE, -VL, 2.5-VL
            qk_norm=mtype.startswith("qwen3"), experts=experts,
            experts_per_tok=c.get("num_experts_per_tok", 0),
            moe_intermediate=c.get("moe_intermediate_size") or (c.get("intermediate_size", 0) if experts else 0),
            shared_intermediate=c.get("shared_expert_intermediate_size", 0), sparse=sparse)

    @classmethod
    def from_path(cls, model_path: str) -> "ModelShape":
        """config.json of ``model_path``; a multimodal config nests the LM in ``text_config`` (older
        Qwen2-VL / Qwen2.5-VL files keep it at the top level) and the ViT in ``vision_config``. The
        image budget comes from ``preprocessor_config.json`` when the folder has one."""
        c = read_config(model_path)
        shape = cls.from_hf_config(c.get("text_config", c))
        if "text_config" in c:  # transformers ties the lm_head by the outer config's flag
            shape = replace(shape, tied=bool(c.get("tie_word_embeddings", False)))
        if "vision_config" not in c:
            return shape
        vision = VisionShape.from_hf_config(c, max_image_tokens(model_path, c["vision_config"]))
        return replace(shape, arch=(c.get("architectures") or [shape.arch])[0], vision=vision,
                       uncounted_vision="" if vision else str(c.get("model_type")))

    # parameter counts (elements) -----------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def embed(self) -> int:
        return self.vocab * self.hidden

    def lm_head(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def attn(self) -> int:
        """q, k, v, o projections (+ qkv bias, + Qwen3's q_norm/k_norm)."""
        h, q, kv = self.hidden, self.q_dim, self.kv_dim
        return h * (q + 2 * kv) + q * h + (q + 2 * kv) * self.qkv_bias + 2 * self.head_dim * self.qk_norm

    def dense_mlp(self) -> int:
        return 3 * self.hidden * self.intermediate  # gate, up, down

    def expert(self) -> int:
        return 3 * self.hidden * self.moe_intermediate  # one routed expert

    def moe_shared(self) -> int:
        """Router, and the Qwen2-MoE shared expert with its gate: not sharded by expert parallelism."""
        shared = 3 * self.hidden * self.shared_intermediate + self.hidden if self.shared_intermediate else 0
        return self.hidden * self.experts + shared

    def layer(self, i: int, ep: int = 1) -> tuple[int, int]:
        """(non-expert, routed-expert) parameters of layer i held by one expert-parallel rank."""
        if self.sparse and self.sparse[i]:
            return self.attn() + 2 * self.hidden + self.moe_shared(), self.experts * self.expert() // ep
        return self.attn() + 2 * self.hidden + self.dense_mlp(), 0

    def root(self) -> int:
        """The FSDP root's parameters: embedding, final norm, untied lm_head, and a vision tower's
        patch/position embeddings and mergers (``VisionShape.root``)."""
        return self.embed() + self.hidden + self.lm_head() + (self.vision.root() if self.vision else 0)

    def vision_params(self) -> int:
        return self.vision.params if self.vision else 0

    def counts(self) -> tuple[int, int]:
        """(non-expert, routed-expert) totals; expert parallelism will shard only the second. The
        vision tower counts with the first."""
        per_layer = [self.layer(i) for i in range(self.layers)]
        blocks = self.vision.depth * self.vision.block() if self.vision else 0
        return self.root() + blocks + sum(d for d, _ in per_layer), sum(e for _, e in per_layer)

    @property
    def params(self) -> int:
        return sum(self.counts())

    def largest_sync_unit(self) -> int:
        """Largest group of parameters the weight sync keeps in one bucket (rlcore.engine.bucket_gather:
        one grandparent module: embed_tokens + final norm, lm_head, a layer's self_attn or mlp,
        one routed expert; of a vision tower, one merger or a block's MLP)."""
        mlp = max((self.moe_shared() if s else self.dense_mlp()) for s in (self.sparse or (False,)))
        vision = max(self.vision.merger(self.vision.merged), self.vision.block()) if self.vision else 0
        return max(self.embed() + self.hidden, self.lm_head(), self.attn(), mlp, self.expert(), vision)

    # activation elements per token --------------------------------------------------------
    def layer_activations(self, i: int) -> int:
        """Elements per token a decoder layer saves for backward: both norms' inputs and outputs
        (4h), q/k/v before and after norm + RoPE (2(q + 2kv)), the attention output (q; flash /
        SDPA kernels keep no (T, T) scores), SwiGLU gate, up, silu(gate), product (4I); a sparse
        layer instead k experts' dispatched input and SwiGLU (k(h + 4I_moe)), router logits in fp32."""
        attn = 4 * self.hidden + 2 * (self.q_dim + 2 * self.kv_dim) + self.q_dim
        if self.sparse and self.sparse[i]:
            k, sh = self.experts_per_tok, self.shared_intermediate
            return attn + k * (self.hidden + 4 * self.moe_intermediate) + 4 * sh + 2 * self.experts
        return attn + 4 * self.intermediate
