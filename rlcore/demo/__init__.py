"""Offline tiny models and tasks for the demos and the tests: nothing is downloaded.

    toy.py   tiny Qwen3 / Qwen3-MoE models, their tokenizer, the toy arithmetic task
    vl.py    a tiny random Qwen3-VL with its processor, the shapes task
    tool.py  the tool demo's task (``configs/demo_tool_cpu.yaml``: ``rlcore.demo.tool:SecretEnv``)
    verl_tasks.py  data in verl's layout and tiny models that write verl's answer formats (the verl tests)
    agent.py the agent demo's agent (``configs/demo_agent_cpu.yaml``): the same task through the
             official openai client, run by the trainer's agent workers (it imports only openai)

May import: torch, transformers, rlcore.task. Nothing imports it at run time except through a
config's dotted path.
"""
