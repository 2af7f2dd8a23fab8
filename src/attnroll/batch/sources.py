"""What a batch job explains: the inputs of a SOURCE, each with a stable id.

A source is an image folder (searched recursively), a text file (one input per line; a tab separates a
sentence pair), a JSONL file (one object per line: ``text`` and optionally ``pair``, ``id``), or a Parquet /
CSV table with a column of image paths or texts (``column="text"`` or ``column="text,pair"``). Listing a
source reads no image: items carry paths, and a corrupt file only fails when it is explained.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

from .._checks import one_line

#: Image file suffixes a folder source picks up (what pillow decodes).
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm")
TEXT_SUFFIXES = (".txt", ".text")
JSONL_SUFFIXES = (".jsonl", ".ndjson")
TABLE_SUFFIXES = (".parquet", ".pq", ".csv")


@dataclass(frozen=True)
class Item:
    """One input: ``index`` its position in the source, ``id`` a unique stable name (relative path, line or
    row), ``kind`` "image" or "text"; images have ``path``, texts ``text`` (and ``pair`` for a pair)."""

    index: int
    id: str
    kind: str
    path: str | None = None
    text: str | None = None
    pair: str | None = None
    target: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "id": self.id, "kind": self.kind, "path": self.path, "text": self.text,
                "pair": self.pair, "target": -1 if self.target is None else self.target}

    @property
    def source(self) -> str:
        """The ``source`` column: the image path, or the text (and pair, after a tab)."""
        if self.kind == "image":
            return str(self.path)
        return self.text if self.pair is None else f"{self.text}\t{self.pair}"


def source_kind(source: str | os.PathLike) -> str:
    """"folder" | "text" | "jsonl" | "table" for a source path; ValueError naming what is accepted."""
    p = Path(source)
    if p.is_dir():
        return "folder"
    if not p.exists():
        raise ValueError(f"source {str(p)!r} does not exist; expected an image folder, a text / JSONL file or a "
                         "Parquet / CSV table")
    suf = p.suffix.lower()
    for kind, sufs in (("text", TEXT_SUFFIXES), ("jsonl", JSONL_SUFFIXES), ("table", TABLE_SUFFIXES)):
        if suf in sufs:
            return kind
    raise ValueError(f"source {str(p)!r}: unsupported file type {suf or '(no suffix)'!r}; expected a folder, "
                     f"{'/'.join(TEXT_SUFFIXES + JSONL_SUFFIXES + TABLE_SUFFIXES)}")


def list_items(source: str | os.PathLike, column: str | None = None, target_column: str | None = None,
               exclude: Sequence[str | os.PathLike] = ()) -> list[Item]:
    """Every input of ``source`` in a stable order (sorted paths, file lines, table rows).

    ``target_column``: a column of a table (or a field of a JSONL file) holding the class index to explain
    per input (a non-negative integer; empty = the predicted class). ``exclude``: folders an image folder's
    search skips (the run's own output folder); a folder holding an ``attnroll batch`` output is skipped
    too, so that overlays are never inputs. Image paths are absolute. A source without any input raises
    ValueError."""
    kind = source_kind(source)
    if column is not None and kind != "table":
        raise ValueError(f"column={column!r} applies to a Parquet / CSV table, but the source {source} is a {kind}")
    if target_column is not None and kind not in ("table", "jsonl"):
        raise ValueError(f"target_column={target_column!r} applies to a Parquet / CSV table or a JSONL file, but the "
                         f"source {source} is a {kind}")
    if kind == "folder":
        items = _folder_items(Path(source), _folder_ids(exclude))
    elif kind == "text":
        items = _text_items(Path(source))
    elif kind == "jsonl":
        items = _jsonl_items(Path(source), target_column)
    else:
        items = _table_items(Path(source), column, target_column)
    if not items:
        raise ValueError(f"source {source}: holds no inputs (an empty {kind}); expected at least one "
                         f"{'row' if kind == 'table' else 'line'}")
    _check_unique(items, source)
    return items


def source_fingerprint(source: str | os.PathLike, items: list[Item]) -> str:
    """``"sha256:<16 hex>"`` of what a source lists: each input's position, id, kind, text, pair, target and
    image path (relative to the source's folder, so that the same source named from another working
    folder gives the same fingerprint). An input added, removed, renamed, moved or edited (texts; a
    table's cell) changes it; an image file rewritten in place does not."""
    import hashlib

    p = Path(source)
    base = os.path.join(os.path.abspath(p if p.is_dir() else p.parent), "")
    cut = len(base)
    # (image paths are absolute: base + the relative path, or a table's own absolute path). One JSON list per
    # field, each encoded in one call: no object per input for the garbage collector to walk (a list per
    # input made 50,000 inputs take 0.13 s, nearly all of it collections)
    columns = ([it.index for it in items], [it.id for it in items], [it.kind for it in items],
               [it.path[cut:] if it.path is not None and it.path.startswith(base) else it.path for it in items],
               [it.text for it in items], [it.pair for it in items], [it.target for it in items])
    h = hashlib.sha256()
    for col in columns:
        h.update(json.dumps(col, ensure_ascii=True).encode("ascii") + b"\n")
    return "sha256:" + h.hexdigest()[:16]


def class_index(value: Any, where: str) -> int | None:
    """A target cell as a class index: None / NaN / "" = the predicted class; else a non-negative integer
    (3, 3.0, "3"); anything else raises ValueError naming ``where``."""
    if value is None or (isinstance(value, float) and value != value) or (isinstance(value, str) and not value.strip()):
        return None
    try:
        f = float(value)
    except (TypeError, ValueError):
        f = float("nan")
    if isinstance(value, bool) or not f.is_integer() or f < 0:
        raise ValueError(f"{where}: a target must be a class index (an integer >= 0, or empty for the predicted "
                         f"class), got {value!r}")
    return int(f)


def _folder_items(root: Path, skip: frozenset = frozenset()) -> list[Item]:
    # Sorted by path components (as pathlib orders paths) and built from strings: listing 20,000 files
    # through Path objects took 1.7 s, most of it Path comparisons and constructions.
    files = sorted(_image_files(str(root), (), skip))
    if not files:
        raise ValueError(f"source {root}: no images in this folder or below (looked for {', '.join(IMAGE_SUFFIXES)})")
    base = os.path.abspath(root)
    return [Item(i, "/".join(parts), "image", path=os.path.join(base, *parts)) for i, parts in enumerate(files)]


def _folder_ids(folders: Sequence[str | os.PathLike]) -> frozenset:
    """(device, inode) of each existing folder of ``folders``."""
    found = set()
    for f in folders:
        try:
            st = os.stat(f)
        except OSError:
            continue
        found.add((st.st_dev, st.st_ino))
    return frozenset(found)


def _is_batch_output(listed: list) -> bool:
    """Whether a folder's entries make it an ``attnroll batch`` output (its manifest names the format)."""
    for e in listed:
        if e.name == "manifest.json" and e.is_file():
            try:
                with open(e.path, encoding="utf-8") as f:
                    return '"attnroll.batch/' in f.read(4096)
            except (OSError, UnicodeDecodeError):
                return False
    return False


def _image_files(root: str, prefix: tuple[str, ...] = (), skip: frozenset = frozenset()) -> Iterator[tuple[str, ...]]:
    """Image files under ``root`` as path components relative to it (one directory listing per folder,
    whose entries know their type: no stat per file), hidden files and folders skipped, symbolic links to
    folders not followed (links to files are files), the folders ``skip`` ((device, inode) pairs) and
    batch outputs below ``root`` left out."""
    try:
        with os.scandir(os.path.join(root, *prefix)) as entries:
            listed = list(entries)
    except OSError:  # an unreadable folder holds no inputs (as os.walk skips it)
        return
    if prefix and _is_batch_output(listed):
        return
    for e in listed:
        if e.name.startswith("."):
            continue
        if e.is_dir(follow_symlinks=False):
            if skip and any(e.inode() == ino and e.stat(follow_symlinks=False).st_dev == dev for dev, ino in skip):
                continue
            yield from _image_files(root, prefix + (e.name,), skip)
        elif os.path.splitext(e.name)[1].lower() in IMAGE_SUFFIXES and e.is_file():
            yield prefix + (e.name,)


def _read_lines(path: Path) -> list[str]:
    try:
        return path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise ValueError(f"source {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _text_items(path: Path) -> list[Item]:
    """One input per line; ``text<TAB>pair`` is a sentence pair. Blank lines are inputs too (they fail as
    empty texts), so that line numbers stay the ids."""
    items = []
    for i, line in enumerate(_read_lines(path)):
        text, _, pair = line.partition("\t")
        items.append(Item(i, f"line:{i + 1}", "text", text=text, pair=pair if "\t" in line else None))
    if not items:
        raise ValueError(f"source {path}: empty file (expected one input per line)")
    return items


def _jsonl_items(path: Path, target_field: str | None = None) -> list[Item]:
    """One JSON object per line: ``text`` (required), ``pair`` (optional), ``id`` (optional, else the line),
    and the class to explain in ``target_field`` (optional per line)."""
    items = []
    for i, line in enumerate(_read_lines(path)):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise ValueError(f"source {path}, line {i + 1}: not JSON ({e})") from None
        if not isinstance(obj, dict) or "text" not in obj:
            raise ValueError(f"source {path}, line {i + 1}: expected an object with a 'text' field (and optionally "
                             f"'pair', 'id'), got {line[:80]!r}")
        pair = obj.get("pair")
        target = None if target_field is None else class_index(obj.get(target_field), f"source {path}, line {i + 1}")
        items.append(Item(len(items), str(obj.get("id", f"line:{i + 1}")), "text", text=_as_text(obj["text"]),
                          pair=None if pair is None else _as_text(pair), target=target))
    if not items:
        raise ValueError(f"source {path}: no JSON lines")
    return items


def _as_text(v: Any) -> str:
    return "" if v is None else str(v)


def _table_items(path: Path, column: str | None, target_column: str | None = None) -> list[Item]:
    """A column of image paths (relative to the table's folder) or texts; ``"text,pair"`` names two columns.
    An ``id`` column, when present, gives the ids; else ``row:N``. ``target_column``: class indices."""
    table = read_table(path)
    if target_column is not None and target_column not in table:
        raise ValueError(f"target_column={target_column!r} is not a column of {path}; its columns: {', '.join(table)}")
    if column is None:
        raise ValueError(f"source {path} is a table: name the column of paths or texts with column= "
                         f"(--column); its columns: {', '.join(table)}")
    cols = [c.strip() for c in column.split(",")]
    missing = [c for c in cols if c not in table]
    if missing or len(cols) > 2:
        raise ValueError(f"column must name one column (or two: text,pair) of {path}, got {column!r}; "
                         f"its columns: {', '.join(table)}")
    values = table[cols[0]]
    pairs = table[cols[1]] if len(cols) == 2 else None
    ids = [str(v) for v in table["id"]] if "id" in table else [f"row:{i}" for i in range(len(values))]
    non_null = [str(v) for v in values if v is not None]
    is_image = pairs is None and bool(non_null) and all(v.lower().endswith(IMAGE_SUFFIXES) for v in non_null)
    targets = ([class_index(t, f"source {path}, row {i}, column {target_column!r}")
                for i, t in enumerate(table[target_column])] if target_column is not None else [None] * len(values))
    items, base = [], Path(os.path.abspath(path.parent))
    for i, v in enumerate(values):
        if is_image:
            p = Path(str(v)) if v is not None else Path("")
            items.append(Item(i, ids[i], "image", path=str(p if p.is_absolute() else base / p),
                              target=targets[i]))
        else:
            items.append(Item(i, ids[i], "text", text=_as_text(v), pair=None if pairs is None else _as_text(pairs[i]),
                              target=targets[i]))
    return items


def read_table(path: Path) -> dict[str, list]:
    """A Parquet or CSV file as {column: list of values} (pyarrow)."""
    try:
        import pyarrow.csv as pcsv
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError("reading a Parquet / CSV source needs pyarrow: pip install 'attnroll[batch]'") from None
    try:
        t = pcsv.read_csv(path) if path.suffix.lower() == ".csv" else pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - pyarrow raises several kinds for a bad file
        raise ValueError(f"source {path}: cannot read this table: {one_line(e)[:200]}") from None
    return t.to_pydict()


def _check_unique(items: list[Item], source: Any) -> None:
    seen: set[str] = set()
    dup = [it.id for it in items if it.id in seen or seen.add(it.id)]
    if dup:
        raise ValueError(f"source {source}: ids must be unique, but {len(dup)} repeat (e.g. {dup[0]!r})")
