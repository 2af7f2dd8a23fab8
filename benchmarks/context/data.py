"""Deterministic prompts for the context-attribution benchmark.

QA: fictional facts the model cannot know ("Zorvath works as a baker in Quelmora."), 8-20 passages, the
evidence passage at varied positions, distractors that share the question's name or its relation words.
The answer is the gold short answer (teacher-forced): it is defined for every prompt, and the LOO ground
truth is measured on it, so every method explains the same tokens (a 135M model's greedy answer is often
not the fact at all). RULER-style: a needle (a magic number) or a variable-tracking chain hidden in filler,
at about 1k, 2k, 4k tokens; segments are chunks of a few sentences.

Every prompt follows ContextCite's own layout, "Context: {context}\n\nQuery: {query}" in a user chat turn,
with passages joined by blank lines; removing a segment re-renders the prompt without it (``render``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

SYL = ["zor", "vath", "mel", "kin", "quel", "mora", "bris", "vane", "tal", "dor", "fen", "rik", "sul", "ven",
       "oth", "gar", "lim", "nex", "pra", "dul", "kor", "bex", "yan", "thi", "mop", "wes", "cal", "ru"]
RELATIONS = {  # relation: (passage pattern, question, values)
    "job": ("{n} works as a {v} in {c}.", "What does {n} work as?",
            ["baker", "tailor", "carpenter", "fisher", "potter", "weaver", "miner", "glassblower"]),
    "pet": ("{n} keeps a pet {v} at home in {c}.", "What pet does {n} keep?",
            ["ferret", "parrot", "tortoise", "hedgehog", "goat", "lizard", "rabbit", "owl"]),
    "music": ("{n} plays the {v} every evening in {c}.", "Which instrument does {n} play?",
              ["violin", "flute", "harp", "drum", "cello", "trumpet", "banjo", "oboe"]),
    "colour": ("The favourite colour of {n} from {c} is {v}.", "What is the favourite colour of {n}?",
               ["green", "purple", "orange", "yellow", "silver", "crimson", "teal", "amber"]),
}
FILLER = ["The market in {c} opens before sunrise.", "{c} is known for its old stone bridge.",
          "Rain falls often over the hills near {c}.", "The road to {c} winds through pine forests.",
          "Travellers to {c} usually arrive by boat.", "A small museum in {c} displays ancient coins."]


@dataclass
class Prompt:
    """One benchmark prompt: the chat-formatted text, its segments, the answer and the gold segment(s)."""

    prompt: str
    segments: list[str]
    question: str
    answer: str
    gold: list[int]
    kind: str
    meta: dict = field(default_factory=dict)


def name(rng: random.Random) -> str:
    """A fictional name of 2-3 syllables, capitalised."""
    return "".join(rng.sample(SYL, rng.choice([2, 3]))).capitalize()


def render(tokenizer, segments: list[str], question: str, keep=None) -> str:
    """The chat prompt with only the kept segments (all when ``keep`` is None), ContextCite's layout."""
    kept = [s for i, s in enumerate(segments) if keep is None or keep[i]]
    user = "Context: " + "\n\n".join(kept) + "\n\nQuery: " + question
    return tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)


def qa_prompt(tokenizer, seed: int, index: int, passages: int | None = None) -> Prompt:
    """One multi-passage QA prompt of ``passages`` passages (8, 12, 16 or 20 drawn when None); the evidence
    position cycles over the passages with ``index``."""
    rng = random.Random(seed * 1000 + index)
    n = rng.choice([8, 12, 16, 20])
    n = n if passages is None else passages
    people = []
    while len(people) < n + 2:
        nm = name(rng)
        if nm not in people:
            people.append(nm)
    who, city = people[0], name(rng)
    rel = rng.choice(sorted(RELATIONS))
    pattern, question, values = RELATIONS[rel]
    value = rng.choice(values)
    passages = [pattern.format(n=who, v=value, c=city)]
    others = [r for r in sorted(RELATIONS) if r != rel]
    for j in range(1, n):
        if j % 3 == 1:  # the same person, another relation: shares the question's name
            r = others[j % len(others)]
            passages.append(RELATIONS[r][0].format(n=who, v=rng.choice(RELATIONS[r][2]), c=name(rng)))
        elif j % 3 == 2:  # another person, the same relation: shares the question's words
            v = rng.choice([x for x in values if x != value])
            passages.append(pattern.format(n=people[j], v=v, c=name(rng)))
        else:
            passages.append(rng.choice(FILLER).format(c=name(rng)))
    distractors = passages[1:]
    rng.shuffle(distractors)
    pos = (index * 7 + seed) % n if index % 4 else (0 if index % 8 == 0 else n - 1)
    passages = distractors[:pos] + [passages[0]] + distractors[pos:]
    q = question.format(n=who)
    return Prompt(render(tokenizer, passages, q), passages, q, value, [pos], "qa",
                  {"n_passages": n, "relation": rel, "evidence": pos})


#: The QA splits and their seeds.
SPLITS = {"validation": 11, "heldout": 29, "validation-b": 37, "heldout-b": 47}


def qa_set(tokenizer, split: str, count: int, passages: int | None = None) -> list[Prompt]:
    """Validation (seed 11) or held-out (seed 29) QA prompts; "validation-b" (seed 37) and "heldout-b" (seed 47)
    are second, disjoint draws for a choice re-made on more validation prompts and a fresh held-out report."""
    seed = SPLITS[split]
    return [qa_prompt(tokenizer, seed, i, passages) for i in range(count)]


def _filler(rng: random.Random) -> str:
    return rng.choice(FILLER).format(c=name(rng))


def _chunks(sentences: list[str], per: int) -> list[str]:
    return [" ".join(sentences[i:i + per]) for i in range(0, len(sentences), per)]


def ruler_prompt(tokenizer, task: str, tokens: int, seed: int) -> Prompt:
    """A needle ("niah") or variable-tracking ("vt") prompt of about ``tokens`` tokens, chunks as segments."""
    rng = random.Random(seed * 7919 + tokens)
    n_sent = max(8, tokens // 12)  # filler sentences average about 12 tokens
    sents = [_filler(rng) for _ in range(n_sent)]
    if task == "niah":
        key, number = name(rng), str(rng.randrange(1000000, 9999999))
        spots = [rng.randrange(n_sent)]
        sents.insert(spots[0], f"The special magic number for {key} is {number}.")
        question, answer = f"What is the special magic number for {key}?", number
    elif task == "vt":
        number, names = str(rng.randrange(10000, 99999)), ["V" + name(rng).upper()[:4] for _ in range(3)]
        chain = [f"VAR {names[0]} = {number}."] + [f"VAR {names[i]} = {names[i - 1]}." for i in (1, 2)]
        spots = sorted(rng.sample(range(n_sent), 3))
        for off, (s, text) in enumerate(zip(spots, chain)):
            sents.insert(s + off, text)
        spots = [s + off for off, s in enumerate(spots)]
        question = f"Which variables are assigned the value {number}?"
        answer = " ".join(names)
    else:
        raise ValueError(f"task must be 'niah' or 'vt', got {task!r}")
    per = 4
    segs = _chunks(sents, per)
    gold = sorted({s // per for s in spots})
    return Prompt(render(tokenizer, segs, question), segs, question, answer, gold, task,
                  {"tokens_target": tokens, "n_segments": len(segs)})
