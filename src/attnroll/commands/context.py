"""``attnroll context``: which parts of a prompt (retrieved passages, sentences, words) a decoder's answer drew
on; with ``--per-token``, every generated token over the prompt and the tokens generated before it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from .._names import safe_name
from ._args import parse_options
from ._data import echo_notes, load, text_or_file
from ._group import cli
from ._output import Failure, one_line, output_file, prepare_out, write

#: Fields of a ``--jsonl`` record.
PROMPT_FIELDS = ("prompt", "question")
PASSAGE_FIELDS = ("passages", "segments")


@dataclass
class Task:
    """One attribution to run: the prompt the model reads, its segments, the answer (or None: generate)."""

    source: str
    prompt: str
    segments: list[str] | None
    stem: str
    answer: str | None = None
    question: str | None = None
    extra: dict = field(default_factory=dict)


def split_passages(text: str) -> list[str]:
    """A passages file's text: blank-line separated blocks when it has blank lines, else one per line."""
    lines = text.replace("\r\n", "\n").split("\n")
    if any(not ln.strip() for ln in lines[:-1]) and sum(1 for ln in lines if ln.strip()) > 1:
        blocks, cur = [], []
        for ln in lines + [""]:
            if ln.strip():
                cur.append(ln.strip())
            elif cur:
                blocks.append("\n".join(cur))
                cur = []
        return blocks
    return [ln.strip() for ln in lines if ln.strip()]


def rag_prompt(passages: list[str], question: str | None) -> tuple[str, list[str]]:
    """The prompt the model reads (the passages, one blank line apart, then the question) and its segments
    (each passage, then the question)."""
    parts = list(passages) + ([question.strip()] if question and question.strip() else [])
    return "\n\n".join(parts), parts


def _read_passages(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {one_line(getattr(e, 'strerror', None) or e)}",
                                 param_hint="--passages") from None
    found = split_passages(text)
    if not found:
        raise click.BadParameter(f"{path} holds no passage (one per line, or blocks separated by blank lines)",
                                 param_hint="--passages")
    return found


def _record_task(rec: Any, where: str, k: int) -> Task:
    """One ``--jsonl`` record as a Task; a usage error naming the line and the field otherwise."""
    if not isinstance(rec, dict):
        raise click.UsageError(f"{where}: a record must be a JSON object, got {type(rec).__name__}")
    q = next((rec[f] for f in PROMPT_FIELDS if f in rec), None)
    given = [f for f in PASSAGE_FIELDS if f in rec]
    if len(given) > 1:
        raise click.UsageError(f"{where}: give 'passages' (the prompt is built from them) or 'segments' (pieces "
                               "of the prompt), not both")
    parts = rec[given[0]] if given else None
    if parts is not None and (not isinstance(parts, list) or not parts
                              or not all(isinstance(p, str) and p.strip() for p in parts)):
        raise click.UsageError(f"{where}: '{given[0]}' must be a non-empty list of non-empty strings")
    if q is not None and (not isinstance(q, str) or not q.strip()):
        raise click.UsageError(f"{where}: 'prompt' / 'question' must be a non-empty string, got {q!r}")
    if q is None and given != ["passages"]:
        raise click.UsageError(f"{where}: a record needs a 'prompt' or 'question' (and optional 'passages' or "
                               "'segments')")
    answer = rec.get("answer")
    if answer is not None and (not isinstance(answer, str) or not answer.strip()):
        raise click.UsageError(f"{where}: 'answer' must be a non-empty string, got {answer!r}")
    rid = rec.get("id")
    label = str(rid) if rid is not None else f"{k:04d}-{_slug(q or parts[0])}"
    if given == ["passages"]:
        prompt, segs = rag_prompt(parts, q)
    else:
        prompt, segs = q, parts
    return Task(where, prompt, segs, safe_name(label), answer, q, {"id": rid} if rid is not None else {})


def read_jsonl(path: Path) -> list[Task]:
    """The records of a ``--jsonl`` file, each checked (a usage error names its line)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise click.BadParameter(f"cannot read {path}: {one_line(getattr(e, 'strerror', None) or e)}",
                                 param_hint="--jsonl") from None
    tasks: list[Task] = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"--jsonl {path} line {i}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise click.UsageError(f"{where}: not JSON ({e.msg})") from None
        tasks.append(_record_task(rec, where, len(tasks)))
    if not tasks:
        raise click.UsageError(f"--jsonl {path}: no records (one JSON object per line)")
    seen: dict[str, str] = {}
    for t in tasks:
        other = seen.setdefault(t.stem.lower(), t.source)
        if other != t.source:
            raise click.UsageError(f"{other} and {t.source} would write the same files ({t.stem}.*): give the "
                                   "records distinct 'id's")
    return tasks


def _slug(text: str) -> str:
    from .explain import slug

    return slug(text)


def build_tasks(prompt: str | None, passages: Path | None, jsonl: Path | None, answer: str | None,
                generate: int | None) -> list[Task]:
    """The tasks of the command's input options; usage errors for a wrong combination."""
    if jsonl is not None:
        if prompt is not None or passages is not None:
            raise click.UsageError("--jsonl takes its prompts and passages from its records: leave out --prompt "
                                   "and --passages")
        tasks = read_jsonl(jsonl)
    elif prompt is None and passages is None:
        raise click.UsageError("nothing to attribute: give --prompt TEXT|FILE (and --passages FILE), or --jsonl FILE")
    else:
        if prompt is not None and not prompt.strip():
            raise click.UsageError("--prompt is empty")
        if passages is not None:
            text, segs = rag_prompt(_read_passages(passages), prompt)
        else:
            text, segs = prompt, None
        tasks = [Task("--prompt" if passages is None else "--passages", text, segs,
                      safe_name(_slug(prompt or text)), None, prompt)]
    if answer is not None and generate is not None:
        raise click.UsageError("give --answer TEXT or --generate N, not both")
    if answer is not None and not answer.strip():
        raise click.UsageError("--answer is empty")
    for t in tasks:
        t.answer = t.answer if t.answer is not None else answer
        if t.answer is None and generate is None:
            raise click.UsageError(f"{t.source}: no answer to attribute: give --answer TEXT or --generate N")
    return tasks


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def ranking_lines(ca: Any, top: int | None, width: int = 70) -> list[str]:
    """The ranked table: rank, share %, the unit's text shortened (passages on one line)."""
    lines = [f"{'#':>3}  {'share' if ca.total > 0 else 'score':>7}  {ca.unit}"]
    for k, u in enumerate(ca.ranked()[:top], 1):
        lines.append(f"{k:>3}  {ca.amount(u)}  {_shorten(u['text'], width)}")
    return lines


def _attribute(lm: Any, task: Task, opts: dict) -> tuple[Any, Any]:
    """(ContextAttribution, GenerationAttribution or None) of one task; the library's refusals as one line."""
    from ..explain.context_attribution import context_attribution
    from ..explain.generation_attribution import generation_attribution

    common = dict(chat_template=opts["chat_template"], sinks=opts["sinks"], method=opts["method"], **opts["options"])
    answer: Any = task.answer
    try:
        ga = None
        if opts["per_token"]:
            ga = generation_attribution(lm.model, lm.tokenizer, task.prompt, answer=answer,
                                        generate=None if answer else opts["generate"], **common)
            answer = ga.answer_ids  # the same tokens, not generated twice
        ca = context_attribution(lm.model, lm.tokenizer, task.prompt, answer=answer,
                                 generate=None if answer else opts["generate"], unit=opts["unit"],
                                 segments=task.segments, **common)
    except (TypeError, ValueError) as e:
        where = f"{task.source}: " if task.source.startswith("--jsonl") else ""
        raise Failure(where + one_line(str(e))) from None
    return ca, ga


def _report(lm: Any, task: Task, ca: Any, ga: Any, top: int, many: bool) -> None:
    if many:
        click.echo(f"== {task.source}" + (f" (id {task.extra['id']})" if "id" in task.extra else ""))
    click.echo(f"answer ({len(ca.answer_ids)} tokens): {ca.answer}")
    what = "passages" if task.segments is not None else f"{ca.unit}s"
    click.echo(f"prompt {what} ranked by share of the answer's {ca.method} relevance"
               + (" (chat template applied)" if ca.chat_template else "") + ":")
    click.echo("\n".join(ranking_lines(ca, top or None)))
    if ca.sinks:
        click.echo(f"(attention sinks at token {', '.join(map(str, ca.sinks))} held {100 * ca.sink_share:.1f}% of "
                   f"the relevance: {'left out' if ca.options.get('sinks') == 'drop' else 'kept'})")
    if ga is not None:
        click.echo(f"per generated token ({ga.matrix.shape[0]} × {ga.matrix.shape[1]} sources), share on the "
                   "prompt and top sources:")
        click.echo(ga.table())


def _files(lm: Any, task: Task, ca: Any, ga: Any) -> list[tuple[str, str]]:
    """(file name, content) of one task: the context JSON + viewer page, and with --per-token the generation's."""
    m = safe_name(ca.method)
    meta = {"model": lm.name, "input": task.source, **task.extra}
    rec = {**meta, **ca.to_dict()}
    title = f"attnroll context: {lm.name}"
    out = [(f"{task.stem}.context.{m}.json", json.dumps(rec, indent=1, ensure_ascii=False)),
           (f"{task.stem}.context.{m}.html", ca.to_html(title=title))]
    if ga is not None:
        out += [(f"{task.stem}.generation.{m}.json", json.dumps({**meta, **ga.to_dict()}, ensure_ascii=False)),
                (f"{task.stem}.generation.{m}.html", ga.to_html(title=f"attnroll generation: {lm.name}"))]
    return out


def write_all(out: Path, files: list[tuple[str, str]]) -> list[Path]:
    """Write every file atomically; on a failure the files this call wrote are removed again (no partial
    output)."""
    written: list[Path] = []
    try:
        for name, content in files:
            written.append(write(output_file(out, name), content))
    except BaseException:
        for p in written:
            p.unlink(missing_ok=True)
        raise
    return written


def _load_decoder(spec: str) -> Any:
    from ..explain.prompts import check_decoder

    lm = load(spec, None, "text")
    try:
        check_decoder(lm.model, "attnroll context")
    except TypeError as e:
        raise Failure(f"--model {spec}: {one_line(str(e))}") from None
    if lm.tokenizer is None:
        raise Failure(f"--model {spec}: no tokenizer found with the model; attnroll context needs one")
    return lm


@cli.command("context", short_help="Which passages / sentences of a prompt a decoder's answer drew on.")
@click.option("--model", "model_spec", required=True, metavar="MODEL",
              help="A decoder-only language model: a local transformers folder or a name load_model knows "
                   "(e.g. smollm2-135m-instruct).")
@click.option("--prompt", callback=text_or_file, metavar="TEXT|FILE",
              help="The prompt (with --passages: the question after them); a value that names a file is read.")
@click.option("--passages", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="FILE",
              help="Retrieved passages, one per line or blocks separated by blank lines: the prompt is the "
                   "passages then --prompt, each passage ranked.")
@click.option("--jsonl", type=click.Path(exists=True, dir_okay=False, path_type=Path), metavar="FILE",
              help="One record per line: 'prompt' or 'question', optional 'passages' or 'segments' (lists of "
                   "strings), 'answer', 'id'; one result per record.")
@click.option("--answer", metavar="TEXT", help="The answer to attribute (a record's own 'answer' wins).")
@click.option("--generate", type=click.IntRange(1), metavar="N", help="Generate N tokens greedily as the answer.")
@click.option("--method", "-m", default=None,
              help="checked (the measured default: EVALUATION.md; gate_grad's ranking with its top r units, "
                   "-o r=4, verified by exact leave-one-out, r more forwards; eager or sdpa kernel, else attn_grad "
                   "is used, warned), gate_grad, attn_grad (any kernel, 1x forward+backward), gae, grad_rollout or "
                   "rollout.")
@click.option("--option", "-o", "options", multiple=True, metavar="KEY=VALUE",
              help="A method option, repeatable: -o alpha=0.9 -o head_fusion=max.")
@click.option("--unit", type=click.Choice(["token", "word", "sentence"]), default="sentence", show_default=True,
              help="The prompt's units (passages, when given, replace them).")
@click.option("--chat-template/--no-chat-template", "chat_template", default=None,
              help="Put the tokenizer's chat template around the prompt [default: when the tokenizer has one and "
                   "the prompt is not templated already].")
@click.option("--sinks", type=click.Choice(["drop", "keep"]), default="drop", show_default=True,
              help="Attention-sink tokens (found on the captured attention): left out of the shares, or kept.")
@click.option("--per-token", is_flag=True,
              help="Also explain every generated token over the prompt and the earlier generated tokens (a "
                   "generated × source matrix; JSON and a viewer page).")
@click.option("--top", default=10, show_default=True, type=click.IntRange(0), help="Rows of the ranking (0: all).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("attnroll-context"), show_default=True,
              help="Output folder (created).")
def context_cmd(model_spec, prompt, passages, jsonl, answer, generate, method, options, unit, chat_template, sinks,
                per_token, top, out) -> None:
    """Attribute a decoder's answer to the parts of its prompt: print the answer and the parts ranked by their
    share (adding up to 100%), and write <name>.context.<method>.json and .html (the viewer) into --out.

    \b
    Examples:
      attnroll context --model smollm2-135m-instruct --prompt "Where does Bob live?" --passages docs.txt --generate 20
      attnroll context --model ./llama-local --prompt prompt.txt --answer "Oslo" --unit sentence -m gae
      attnroll context --model ./llama-local --jsonl questions.jsonl --generate 30 --out results/
      attnroll context --model ./llama-local --prompt prompt.txt --generate 10 --per-token
    """
    tasks = build_tasks(prompt, passages, jsonl, answer, generate)
    opts = _check_method(method, per_token, parse_options(options))
    opts.update(generate=generate, unit=unit, chat_template=chat_template, sinks=sinks, per_token=per_token)
    out = prepare_out(out)
    lm = _load_decoder(model_spec)
    results = [(t, *_attribute(lm, t, opts)) for t in tasks]  # everything computed before anything is written
    files = []
    for t, ca, ga in results:
        _report(lm, t, ca, ga, top, len(tasks) > 1)
        files += _files(lm, t, ca, ga)
    written = write_all(out, files)
    echo_notes(model_spec, lm)
    click.echo(f"wrote {len(written)} files to {out}/")


def _check_method(method: str | None, per_token: bool, options: dict) -> dict:
    """The method among context attribution's (and generation attribution's, with --per-token)."""
    from ..explain.context_attribution import METHODS
    from ..explain.generation_attribution import METHODS as PER_TOKEN

    names = PER_TOKEN if per_token else METHODS
    if method is not None and method not in names:
        raise click.UsageError(f"--method {method!r}: {'--per-token takes' if per_token else 'one of'} "
                               f"{', '.join(names)}")
    return {"method": method, "options": options}
