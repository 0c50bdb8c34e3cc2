"""What is learned: the prompts, the images in them, and the rule-based rewards.

    config.py   the ``data`` section (DataConfig), re-exported by rlcore.config
    prompts.py  prompt data: local JSONL or Parquet rows -> tokenized prompts, a seeded order per
                epoch and a position a checkpoint stores; bad rows named
    images.py   images in prompts: decoding, the HF processor, placeholder expansion, M-RoPE positions
    rewards.py  rule-based and custom reward functions and their combination
    reward_fn.py  reward.fn loaded and called in its signature (rlcore's or verl's compute_score)
    timeouts.py   time limits on reward code
    verl_rows.py  verl's data rows: recognised, read with no data.* key set, written
    verl_scores/  verl's rule-based scorers by data_source (the ``verl`` reward component)
    convert.py    data layouts converted (scripts/convert_data.py): public math sets, verl's rows

May import: transformers (tokenizers, processors), math-verify, sympy, pylatexenc and mathruler
(verl's scorers grade with them), the ground floor. Not vLLM, not VeOmni, and not the config
package (it imports this wing's section).
"""
