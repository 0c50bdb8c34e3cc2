"""What is learned: the prompts, the images in them, and the rule-based rewards.

    config.py   the ``data`` section (DataConfig), re-exported by rlcore.config
    prompts.py  prompt data: local JSONL or Parquet rows -> tokenized prompts, a seeded order per
                epoch and a position a checkpoint stores; bad rows named
    images.py   images in prompts: decoding, the HF processor, placeholder expansion, M-RoPE positions
    rewards.py  rule-based and custom reward functions and their combination

May import: transformers (tokenizers, processors), the ground floor. Not vLLM, not VeOmni, and
not the config package (it imports this wing's section).
"""
