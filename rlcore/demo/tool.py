"""Offline assets of the tool demo (configs/demo_tool_cpu.yaml): a task no policy can solve without
its tool, a tiny random Qwen3 whose word-level vocabulary holds the task, and a chat template
that renders tools and tool messages.

The task ("ask for the secret"): every prompt is the same question, ``secret ?``; each row has its
own secret digit, which only the ``lookup`` tool reveals (the environment :class:`SecretEnv`
answers it). Without the tool the best policy guesses one digit: 1 in 10. With it, the model
calls ``lookup`` (one token: ``<tool_call>{"name":"lookup","arguments":{}}</tool_call>``, which
vLLM's hermes parser reads), reads the tool's message and copies the digit.
"""

from __future__ import annotations

from rlcore.demo.toy import DIGITS, SPECIAL, make_tiny_model, write_splits

CALL = '<tool_call>{"name":"lookup","arguments":{}}</tool_call>'
WORDS = ["user", "assistant", "tool", "tools", "lookup", "secret", "?", CALL]
VOCAB = SPECIAL + DIGITS + WORDS

# Every message: role, content, <eos>; the tools' names first when there are any. Words are
# separated by spaces (the tokenizer splits on whitespace), so the end-of-turn separator is " ".
CHAT_TEMPLATE = (
    "{%- set call = '" + CALL + "' %}"
    "{%- if tools %}tools{% for t in tools %} {{ t.function.name }}{% endfor %} <eos> {% endif %}"
    "{%- for m in messages %}{{ m.role }} {% if m.content %}{{ m.content }} {% endif %}"
    "{%- for c in m.tool_calls or [] %}{{ call }} {% endfor %}<eos> {% endfor %}"
    "{%- if add_generation_prompt %}assistant {% endif %}"
)
LOOKUP_SCHEMA = {"type": "function", "function": {
    "name": "lookup", "description": "Reveal this question's secret digit.",
    "parameters": {"type": "object", "properties": {}, "required": []}}}


def make_tool_tokenizer(out_dir: str) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={t: i for i, t in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def make_tool_model(out_dir: str, seed: int = 0) -> str:
    """The tiny random Qwen3 of the demo, with the tool vocabulary and chat template."""
    make_tiny_model(out_dir, seed=seed, vocab_size=len(VOCAB))
    make_tool_tokenizer(out_dir)  # replaces the toy tokenizer written by make_tiny_model
    return out_dir


def make_tool_data(out_dir: str, *, n_train: int = 2000, n_val: int = 200, seed: int = 0) -> tuple[str, str]:
    """tool_train.jsonl / tool_val.jsonl: the one question, each row with its own secret digit."""
    return write_splits(out_dir, "tool", n_train, n_val, seed,
                        lambda rng: {"prompt": "secret ?", "answer": rng.choice(DIGITS)})


class SecretEnv:
    """``env.cls`` of the demo: a ``lookup`` call gets the row's secret; a turn without a call is the
    answer, rewarded 1 when its first word is the secret, plus ``call_bonus`` if the conversation
    called lookup. The bonus (< 1, so it never counts as correct) makes calls common enough early
    that the model gets to learn to read the answer: from a random start the right digit after a
    call is as rare as a blind guess, and without it the demo stalls at chance."""

    tool_schemas = [LOOKUP_SCHEMA]

    def __init__(self, call_bonus: float = 0.0):
        self.call_bonus = call_bonus

    def reset(self, row: dict) -> list[dict]:
        self.secret, self.called = str(row["answer"]), False
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages: list[dict]) -> tuple[list[dict], float | None, bool]:
        last = messages[-1]
        if last.get("tool_calls"):
            self.called = True
            answers = [self.secret if c["function"]["name"] == "lookup" else "?" for c in last["tool_calls"]]
            return [{"role": "tool", "content": a} for a in answers], None, False
        words = (last.get("content") or "").split()
        right = bool(words) and words[0] == self.secret
        return [], float(right) + self.call_bonus * self.called, True


CHATML_SPECIAL = ["<|endoftext|>", "<|im_end|>", "<|im_start|>", "<tool_call>", "</tool_call>", "<tool_response>",
                  "</tool_response>", "<think>", "</think>"]


def make_chatml_tool_model(out_dir: str, template_path: str, seed: int = 0) -> str:
    """A tiny random Qwen3 with a byte-level BPE tokenizer (trained here on a few rendered
    conversations) and the chat template at ``template_path`` (e.g. Qwen3's): the tests' second
    template. ``<|im_end|>`` is id 1, the model's EOS; ``<|endoftext|>`` id 0, its pad."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    with open(template_path) as f:
        template = f.read()
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [template, "system user assistant tool You are a helpful assistant. What is 12 + 7 * 3 ?",
              '{"name": "calculator", "arguments": {"expression": "1 + 2"}}', "0 1 2 3 4 5 6 7 8 9 = + - * / ( )"]
    tok.train_from_iterator(corpus * 4, trainers.BpeTrainer(
        vocab_size=400, special_tokens=CHATML_SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    make_tiny_model(out_dir, seed=seed, vocab_size=tok.get_vocab_size(), max_position_embeddings=2048)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   unk_token=None)
    fast.chat_template = template
    fast.save_pretrained(out_dir)
    return out_dir
