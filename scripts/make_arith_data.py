"""Generate arithmetic problems with exact integer answers, offline and reproducibly.

    python scripts/make_arith_data.py --out data/ [--style word|bare]
        -> data/arith_train.jsonl (--n-train rows, --seed) and
           data/arith_val.jsonl   (--n-val rows, --seed + 1, no prompt shared with train)

Each row: {"prompt": "<text>", "answer": "<integer>", "op": "add|sub"}. Two styles:

  --style word (default): a word problem, then an instruction on its own line; answers >= 0
    (a subtraction's larger operand comes first). Default --max-operand 9.
    {"prompt": "Leo had 7 cards and lost 1. How many cards does Leo have now?\\nGive only the final answer as a number.", "answer": "6", "op": "sub"}
  --style bare: a bare expression on one line; a subtraction's operands are drawn independently,
    so answers may be negative ("-48"). Default --max-operand 99.
    {"prompt": "What is 37 - 85? Answer with just the number.", "answer": "-48", "op": "sub"}

``--with-carries`` adds "carries": the columns in which the written computation carries (add) or
borrows (sub, the larger operand minus the smaller), for per-kind accuracy (``scripts/bench_learning.py
--breakdown op,carries``); without it the files stay byte for byte what they were.

The prompt is plain text; the trainer wraps it in the model's chat template
(data.apply_chat_template=true). Difficulty knobs: --max-operand and --ops. The answer is a
plain integer string (a leading '-' when negative), which the "last_number" reward checks (the
symbolic "math" reward would also accept a response that merely restates the question: math-verify
evaluates "37 - 85" to -48).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re

NAMES = ["Tom", "Anna", "Ben", "Mia", "Sam", "Lily", "Max", "Emma", "Leo", "Zoe", "Jack", "Nora"]
ITEMS = ["apples", "books", "coins", "pencils", "marbles", "stickers", "cookies", "cards", "shells", "toys"]
INSTRUCTION = "Give only the final answer as a number."
BARE_INSTRUCTION = "Answer with just the number."
BARE_SYMBOL = {"add": "+", "sub": "-"}
STYLES = ("word", "bare")
DEFAULT_MAX_OPERAND = {"word": 9, "bare": 99}

# {n}: name, {it}: item, {a}, {b}: operands
ADD = [
    "{n} has {a} {it}. {n} gets {b} more {it}. How many {it} does {n} have now?",
    "There are {a} {it} in a box and {b} {it} on the table. How many {it} are there in total?",
    "{n} found {a} {it} on Monday and {b} {it} on Tuesday. How many {it} did {n} find altogether?",
    "What is {a} plus {b}?",
]
SUB = [
    "{n} has {a} {it} and gives away {b} of them. How many {it} does {n} have left?",
    "There were {a} {it} in a jar. {b} were taken out. How many {it} are in the jar now?",
    "{n} had {a} {it} and lost {b}. How many {it} does {n} have now?",
    "What is {a} minus {b}?",
]


def carries(a: int, b: int, op: str) -> int:
    """Columns of the schoolbook computation that carry (a + b) or borrow (max - min of a, b)."""
    if op == "sub":
        a, b = max(a, b), min(a, b)
    count, carry = 0, 0
    while a or b:
        da, db = a % 10, b % 10
        if op == "add":
            carry = int(da + db + carry >= 10)
        else:
            carry = int(da - db - carry < 0)
        count += carry
        a, b = a // 10, b // 10
    return count


def with_carries(row: dict) -> dict:
    """The row with its "carries" field (the operands read back from the prompt)."""
    a, b = (int(x) for x in re.findall(r"\d+", row["prompt"])[:2])
    return {**row, "carries": carries(a, b, row["op"])}


def make_problem(rng: random.Random, max_operand: int, ops: list[str], style: str = "word") -> dict:
    if style == "bare":
        return make_bare_problem(rng, max_operand, ops)
    op = rng.choice(ops)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if op == "sub" and b > a:
        a, b = b, a  # non-negative answers
    template = rng.choice(ADD if op == "add" else SUB)
    text = template.format(n=rng.choice(NAMES), it=rng.choice(ITEMS), a=a, b=b)
    answer = a + b if op == "add" else a - b
    return {"prompt": f"{text}\n{INSTRUCTION}", "answer": str(answer), "op": op}


def make_bare_problem(rng: random.Random, max_operand: int, ops: list[str]) -> dict:
    """"What is a - b? ..." with a and b drawn independently: b > a gives a negative answer."""
    op = rng.choice(ops)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    answer = a + b if op == "add" else a - b
    return {"prompt": f"What is {a} {BARE_SYMBOL[op]} {b}? {BARE_INSTRUCTION}", "answer": str(answer), "op": op}


def distinct_bare_prompts(max_operand: int, ops: list[str]) -> int:
    return len(set(ops)) * max_operand * max_operand


def make_split(seed: int, n: int, max_operand: int, ops: list[str], exclude: set[str],
               style: str = "word") -> list[dict]:
    rng, rows, seen = random.Random(seed), [], set(exclude)
    attempts = 0
    while len(rows) < n:
        attempts += 1
        if attempts > 100 * n:
            raise SystemExit(f"error: only {len(rows)} distinct problems found for --n {n}; "
                             "raise --max-operand or lower the row counts")
        row = make_problem(rng, max_operand, ops, style)
        if row["prompt"] not in seen:
            seen.add(row["prompt"])
            rows.append(row)
    return rows


def write_jsonl(path: str, rows: list[dict]) -> None:
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data")
    ap.add_argument("--n-train", type=int, default=4000)
    ap.add_argument("--n-val", type=int, default=300)
    ap.add_argument("--style", default="word", choices=STYLES,
                    help="word: word problems with answers >= 0 (the default); bare: bare expressions "
                         "like 'What is 37 - 85?' whose answers may be negative")
    ap.add_argument("--max-operand", type=int, default=None,
                    help="operands are drawn from 1..MAX_OPERAND (default: 9 for --style word, 99 for bare)")
    ap.add_argument("--ops", default="add,sub", help="comma-separated subset of add,sub")
    ap.add_argument("--seed", type=int, default=0, help="train seed; the validation split uses seed + 1")
    ap.add_argument("--with-carries", action="store_true",
                    help='add a "carries" field to each row (columns that carry or borrow); same problems')
    args = ap.parse_args()
    ops = [o.strip() for o in args.ops.split(",") if o.strip()]
    bad = [o for o in ops if o not in ("add", "sub")]
    if bad or not ops:
        raise SystemExit(f"error: --ops={args.ops!r} is invalid: use a comma-separated subset of add,sub")
    if args.max_operand is None:
        args.max_operand = DEFAULT_MAX_OPERAND[args.style]
    if args.max_operand < 1:
        raise SystemExit(f"error: --max-operand={args.max_operand} is invalid: it must be >= 1")
    if args.style == "bare":
        capacity = distinct_bare_prompts(args.max_operand, ops)
        if args.n_train + args.n_val > capacity:
            raise SystemExit(f"error: --style bare with --max-operand={args.max_operand} and --ops={args.ops} has "
                             f"only {capacity} distinct problems, fewer than --n-train + --n-val = "
                             f"{args.n_train + args.n_val}; raise --max-operand or lower the row counts")
    os.makedirs(args.out, exist_ok=True)
    val = make_split(args.seed + 1, args.n_val, args.max_operand, ops, set(), args.style)
    # Held-out: no validation problem (same wording and numbers) appears in training.
    train = make_split(args.seed, args.n_train, args.max_operand, ops, {r["prompt"] for r in val}, args.style)
    if args.with_carries:
        train, val = [with_carries(r) for r in train], [with_carries(r) for r in val]
    write_jsonl(os.path.join(args.out, "arith_train.jsonl"), train)
    write_jsonl(os.path.join(args.out, "arith_val.jsonl"), val)
    print(f"wrote {len(train)} train and {len(val)} validation problems to {args.out}/")


if __name__ == "__main__":
    main()
