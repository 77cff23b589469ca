"""Chat requests whose answers repeat their prompts: the "editing workload" of
bench/serving/spec_decode.py, where n-gram speculative decoding should pay.

Built offline from this repository's own text (nothing is downloaded), the
same requests for the same seed and the same checkout:

- `edit`: "Return this file with one name changed": a small Python source
  file of the server (30 to 70 lines, from common/, scheduler_proc/,
  tokenizer_proc/, model_proc/), to be returned unchanged but for one
  identifier, both names given;
- `quote`: "quote the key sentences of this paragraph, then summarise it":
  a prose paragraph of README.md or docs/architecture.md;
- `json`: a small JSON object of ServerArgs' field names and defaults, to be
  returned with one key renamed.

Every request is one user message (the server applies the model's chat
template), greedy, with its own `max_tokens`. `editing_workload` mixes the
three, edits half of it: edit, quote, edit, json, edit, ...
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import json
import keyword
import os
import random
import re
from dataclasses import dataclass
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCE_FOLDERS = ("common", "scheduler_proc", "tokenizer_proc", "model_proc")
DOCS = ("README.md", "docs/architecture.md")
MIN_LINES, MAX_LINES = 30, 70
MIN_PARAGRAPH, MAX_PARAGRAPH = 300, 1200  # characters of a paragraph worth quoting from
JSON_KEYS = (8, 12)  # keys of a JSON object, the least and the most
KINDS = ("edit", "quote", "json")
MIX = ("edit", "quote", "edit", "json")  # editing_workload's pattern, repeated
# new names: plainly derived from the old, so the model is asked for a rename, not an invention
SNAKE_RENAMES = ("{}_v2", "new_{}", "{}_renamed")
CAMEL_RENAMES = ("{}V2", "New{}", "{}Renamed")
CONSTANT_RENAMES = ("{}_V2", "NEW_{}", "{}_RENAMED")
NOT_RENAMED = {"self", "cls"}
KEY_RENAMES = ("{}_value", "default_{}", "{}_setting")


@dataclass(frozen=True)
class ChatRequest:
    kind: str         # one of KINDS
    source: str       # where its text came from: a path (and a paragraph's number), or ServerArgs
    prompt: str       # the one user message
    max_tokens: int
    reference: str | None = None  # the answer a perfect model gives (edit, json); None for quote

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}]


def _word(name: str) -> re.Pattern[str]:
    return re.compile(rf"(?<![\w.]){re.escape(name)}(?!\w)")


def source_files(root: str = ROOT) -> list[str]:
    """The Python files directly under SOURCE_FOLDERS of MIN_LINES to
    MAX_LINES lines, as paths relative to root, sorted."""
    found = []
    for folder in SOURCE_FOLDERS:
        path = os.path.join(root, folder)
        if not os.path.isdir(path):
            continue
        for name in sorted(os.listdir(path)):
            if name.endswith(".py") and name != "__init__.py":
                with open(os.path.join(path, name)) as f:
                    lines = f.read().count("\n")
                if MIN_LINES <= lines <= MAX_LINES:
                    found.append(f"{folder}/{name}")
    return found


def rename_candidates(source: str) -> list[str]:
    """Names defined in a file (functions, classes, arguments, assigned
    names) that a rename can take whole: 4 characters or more, no builtin or
    dunder, 2 to 12 occurrences as a word and never as an attribute (`x.name`
    may be another object's), so "everywhere it occurs" is unambiguous."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.arg):
            names.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    out = []
    for name in sorted(names):
        if (len(name) < 4 or name.startswith("__") or name in NOT_RENAMED or keyword.iskeyword(name)
                or hasattr(builtins, name)):
            continue
        if f".{name}" in source:
            continue
        if 2 <= len(_word(name).findall(source)) <= 12:
            out.append(name)
    return out


def new_name(old: str, rng: random.Random) -> str:
    """old in one of its own style's renames (snake_case, CamelCase,
    CONSTANT), a private name staying private."""
    bare = old.lstrip("_")
    templates = CONSTANT_RENAMES if bare.isupper() else CAMEL_RENAMES if bare[:1].isupper() else SNAKE_RENAMES
    return old[:len(old) - len(bare)] + rng.choice(templates).format(bare)


def edit_prompt(path: str, source: str, old: str, new: str) -> str:
    return (f"Return this file with one name changed: rename `{old}` to `{new}` everywhere it occurs, and "
            f"change nothing else. Reply with the whole file in one ```python code block and nothing else.\n\n"
            f"File {path}:\n```python\n{source}```")


def edit_requests(n: int, seed: int, max_tokens: int, root: str = ROOT) -> list[ChatRequest]:
    """n file edits: the files in a seeded order (a file comes again, with
    another name to change, only when n exceeds them)."""
    rng = random.Random(f"edit-{seed}")
    files = [p for p in source_files(root) if rename_candidates(_read(root, p))]
    if not files:
        raise ValueError(f"no source file of {MIN_LINES}-{MAX_LINES} lines under {root}")
    rng.shuffle(files)
    out = []
    for i in range(n):
        path = files[i % len(files)]
        source = _read(root, path)
        names = rename_candidates(source)
        old = rng.choice(names)
        new = new_name(old, rng)
        if _word(new).search(source):  # taken already: a name nothing else uses
            new = f"{new}_{i}"
        reference = "```python\n" + _word(old).sub(new, source) + "```"
        out.append(ChatRequest("edit", path, edit_prompt(path, source, old, new), max_tokens, reference))
    return out


def paragraphs(markdown: str) -> list[str]:
    """The prose paragraphs of a markdown text, each on one line: no code
    block, heading, table, list, quote or comment; MIN_PARAGRAPH to
    MAX_PARAGRAPH characters, two sentences or more."""
    out, block, fenced = [], [], False
    for line in markdown.splitlines() + [""]:
        if line.lstrip().startswith("```"):
            fenced, block = not fenced, []
            continue
        if fenced:
            continue
        if line.strip():
            block.append(line.strip())
            continue
        if block and not re.match(r"[#|>\-*<!]|\d+\.", block[0]):
            text = " ".join(block)
            if MIN_PARAGRAPH <= len(text) <= MAX_PARAGRAPH and len(re.findall(r"[.!?] ", text)) >= 1:
                out.append(text)
        block = []
    return out


def quote_prompt(paragraph: str) -> str:
    return ("Quote the two or three key sentences of this paragraph word for word, each on its own line "
            "starting with \"> \", then summarise the paragraph in one sentence.\n\n"
            f"Paragraph:\n{paragraph}")


def quote_requests(n: int, seed: int, max_tokens: int, root: str = ROOT) -> list[ChatRequest]:
    rng = random.Random(f"quote-{seed}")
    found = [(f"{doc} paragraph {k}", p) for doc in DOCS if os.path.isfile(os.path.join(root, doc))
             for k, p in enumerate(paragraphs(_read(root, doc)))]
    if not found:
        raise ValueError(f"no paragraph of {MIN_PARAGRAPH}-{MAX_PARAGRAPH} characters in {', '.join(DOCS)}")
    rng.shuffle(found)
    return [ChatRequest("quote", src, quote_prompt(p), max_tokens) for src, p in
            (found[i % len(found)] for i in range(n))]


def server_arg_defaults() -> dict[str, Any]:
    """ServerArgs' fields whose defaults are JSON scalars, in its order: the facts the JSON objects are made of."""
    from common.server_args import ServerArgs

    return {f.name: f.default for f in dataclasses.fields(ServerArgs)
            if f.default is None or isinstance(f.default, (str, int, float, bool))}


def json_prompt(text: str, old: str, new: str) -> str:
    return (f"Return this JSON object with the key \"{old}\" renamed to \"{new}\"; keep every other key and "
            f"every value as it is, in the same order. Reply with the JSON only.\n\n{text}")


def json_requests(n: int, seed: int, max_tokens: int) -> list[ChatRequest]:
    rng = random.Random(f"json-{seed}")
    facts = server_arg_defaults()
    names = list(facts)
    out = []
    for _ in range(n):
        keys = sorted(rng.sample(range(len(names)), rng.randint(*JSON_KEYS)))  # ServerArgs' order
        obj = {names[k]: facts[names[k]] for k in keys}
        old = rng.choice(list(obj))
        new = rng.choice(KEY_RENAMES).format(old)
        renamed = {(new if k == old else k): v for k, v in obj.items()}
        out.append(ChatRequest("json", "common/server_args.py ServerArgs",
                               json_prompt(json.dumps(obj, indent=2), old, new), max_tokens,
                               json.dumps(renamed, indent=2)))
    return out


def editing_workload(n: int, seed: int = 1, max_tokens: int = 256, root: str = ROOT) -> list[ChatRequest]:
    """n requests in MIX's pattern (edit, quote, edit, json, ...); each kind's
    requests are drawn from its own seeded order, so a longer workload
    begins with a shorter one's requests."""
    counts = {kind: sum(1 for i in range(n) if MIX[i % len(MIX)] == kind) for kind in KINDS}
    pools = {"edit": iter(edit_requests(counts["edit"], seed, max_tokens, root)),
             "quote": iter(quote_requests(counts["quote"], seed, max_tokens, root)),
             "json": iter(json_requests(counts["json"], seed, max_tokens))}
    return [next(pools[MIX[i % len(MIX)]]) for i in range(n)]


def _read(root: str, path: str) -> str:
    with open(os.path.join(root, path)) as f:
        return f.read()
