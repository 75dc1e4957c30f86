"""The class table's file (format ``swapaware-admission/2``): compact, line-oriented. Pure.

slurmctld reloads the table under its one Lua mutex, so the file is shaped for that reload
(slurm_plugin/swapaware_table.lua): one small JSON header, the distinct decisions once each, and
one plain line per key that the Lua indexes with ``string.find`` alone; a decision's JSON is
decoded the first time a job uses it.

    swapaware-admission/2\\n
    {"version": <16 hex>, "generated_at": s, "valid_until": s, "dialect": .., "mode": ..,
     "per_qos": bool, "decisions": D, "entries": E}\\n           (one line)
    <decision JSON>\\n                                           (D lines, numbered from 1)
    <digest>\\t<key>\\t<entry number, 7 digits>\\t<refs>\\n        (E lines)
    end\\n

``<digest>``: ``key_digest`` of the key, 16 hex. The plugin indexes the lines by it: Lua 5.1 hashes
a string longer than 31 bytes from every (length / 32 + 1)-th byte only, so keys that differ
between those bytes (job names run_001..run_999, time limits) share one hash, and indexing them by
the key itself costs time quadratic in their number (measured: 10,000 keys of 1,000 classes with
1,440 time limits had 20 distinct Lua hashes). The digest is never trusted alone: a job's line is
used only when its key equals the job's whole key (a digest two keys share: the newer is written,
the other takes the RPC path).
``<key>``: ``admission.table_key`` with "\\\\", TAB and LF written as "\\\\\\\\", "\\\\t", "\\\\n" (the
plugin escapes a job's key the same way before it looks it up). ``<refs>``: the state letters
(``admission.STATE_LETTER``) each followed by its decision's number, space-separated (``s3 n4 l4
u7``), or ``a<n>`` alone for an entry held alike in every state.

A decision is ``admission.table_decision``'s object, its AdminComment template with the 29
characters of the table token (``tbl=<version>:<i><g>``, right after ``id=IDIDIDIDIDIDIDID ``)
replaced by ``TOKEN_PLACEHOLDER``: the same decision serves every entry and state, and the plugin
writes the token from the file's version, the entry's number and the state's letter. The token has
a fixed length, so the template was cut to policy.admin_comment_max_chars exactly as the complete
one: the AdminComment the plugin builds is byte for byte the template the archive holds.

The last line ``end`` and the header's counts tell a whole file from a truncated one.
"""
from __future__ import annotations

import itertools
import json
import re
from typing import Iterable, Iterator, Mapping, NamedTuple, Sequence

from policy_service.core.admission import LETTER_STATE, PLACEHOLDER_ID, STATE_LETTER, TABLE_FORMAT, \
    TOKEN_CHARS, TableRef

END = "end"
TOKEN_PLACEHOLDER = "tbl=" + "V" * 16 + ":" + "N" * (TOKEN_CHARS - 22) + "G"
_ID_TOKEN = f"id={PLACEHOLDER_ID} tbl="
_ESCAPE = {"\\": "\\\\", "\t": "\\t", "\n": "\\n"}
_UNESCAPE = re.compile(r"\\(.)")
_REFS = re.compile(r"^(?:a[0-9]+|[snlu][0-9]+(?: [snlu][0-9]+)*)$")
_HEADER = ("version", "generated_at", "valid_until", "dialect", "mode", "per_qos")
assert len(TOKEN_PLACEHOLDER) == TOKEN_CHARS


def key_digest(key: str) -> str:
    """16 hex of two polynomial hashes over every byte of the key (the plugin's T.digest)."""
    h1, h2 = len(key.encode()), 0
    for b in key.encode():
        h1 = (h1 * 31 + b) % 4294967296
        h2 = (h2 * 65599 + b) % 4294967291
    return f"{h1:08x}{h2:08x}"


def escape_key(key: str) -> str:
    return key.translate(str.maketrans(_ESCAPE)) if ("\\" in key or "\t" in key or "\n" in key) else key


def unescape_key(text: str) -> str:
    return _UNESCAPE.sub(lambda m: {"t": "\t", "n": "\n"}.get(m.group(1), m.group(1)), text)


def _token_at(comment: str) -> int:
    """Where the table token starts in an AdminComment template (-1: it holds none whole)."""
    at = comment.find(_ID_TOKEN)
    if at < 0 or len(comment) < at + len(_ID_TOKEN) - 4 + TOKEN_CHARS:
        return -1
    return at + len(_ID_TOKEN) - 4


def _comment(decision) -> tuple[str, int]:
    """(a decision's AdminComment template, where its token starts: -1 when it holds none whole)."""
    fields = decision.get("set") if isinstance(decision, dict) else None
    comment = fields.get("admin_comment") if isinstance(fields, dict) else None
    return (comment, _token_at(comment)) if isinstance(comment, str) else ("", -1)


def shared(decision) -> object:
    """``decision`` with its template's token replaced by TOKEN_PLACEHOLDER (as it is when it
    holds no whole token: the plugin then refuses it, as it refuses any such decision)."""
    comment, at = _comment(decision)
    if at < 0:
        return decision
    out = dict(decision, set=dict(decision["set"]))
    out["set"]["admin_comment"] = comment[:at] + TOKEN_PLACEHOLDER + comment[at + TOKEN_CHARS:]
    return out


def decision_text(decision) -> str:
    """A decision's line (shared form, ASCII JSON: no raw line break)."""
    return json.dumps(shared(decision), separators=(",", ":"))


def _filled(decision, ref: TableRef):
    comment, at = _comment(decision)
    if at < 0 or comment[at:at + TOKEN_CHARS] != TOKEN_PLACEHOLDER:
        return decision
    out = dict(decision, set=dict(decision["set"]))
    out["set"]["admin_comment"] = comment[:at] + ref.token + comment[at + TOKEN_CHARS:]
    return out


def entry_line(digest: str, key: str, entry: int, refs: Sequence[tuple[str, int]]) -> str:
    """A key's line: ``refs`` = (state or "*", decision number) pairs."""
    return f"{digest}\t{escape_key(key)}\t{entry:07d}\t{' '.join(f'{STATE_LETTER[s]}{n}' for s, n in refs)}\n"


def header_lines(doc: Mapping, decisions: int, entries: int | None) -> str:
    head = {name: doc[name] for name in _HEADER if name in doc}
    head.update(decisions=decisions, entries=entries)
    return f"{doc.get('format', TABLE_FORMAT)}\n{json.dumps(head, separators=(',', ':'))}\n"


class Decisions:
    """The distinct decisions of one file, numbered from 1 in the order first seen."""

    def __init__(self) -> None:
        self.numbers: dict[str, int] = {}

    def number(self, text: str) -> int:
        n = self.numbers.get(text)
        if n is None:
            n = self.numbers[text] = len(self.numbers) + 1
        return n

    def lines(self) -> Iterator[str]:
        for text in self.numbers:  # insertion order: by number
            yield text + "\n"


def _entry_number(entry: Mapping) -> int:
    """The entry's "i", else the number in its first decision's token (documents written by hand)."""
    if isinstance(entry.get("i"), int):
        return entry["i"]
    for d in entry.values():
        comment, at = _comment(d)
        if at >= 0 and comment[at + 21:at + TOKEN_CHARS - 1].isdigit():
            return int(comment[at + 21:at + TOKEN_CHARS - 1])
    return 0


class Body(NamedTuple):
    """A table file less its header: what stays the same when only the header's times change."""

    decisions: int  # the distinct decisions it holds
    entries: int | None  # its keys (None: a header that counts none, as a broken file)
    pieces: tuple[bytes, ...]


def table_body(entries: Iterable[tuple[str, str, int, Iterable[tuple[str, str]]]] | None,
               piece_bytes: int = 1 << 20) -> Body:
    """The body of a table's file in pieces of about ``piece_bytes``: ``entries`` are (digest, key,
    entry number, (state, decision text) pairs) in the order written (the publisher's: entry
    order); a key whose digest an earlier one has is left out (the RPC path decides it). Each
    distinct decision is written once and each key's line names its decisions by number. Built one
    line at a time, so no single step holds the GIL for long."""
    decisions = Decisions()
    digests: set[str] = set()
    kept = []
    for digest, key, number, states in entries or ():
        if digest not in digests:
            digests.add(digest)
            kept.append((digest, key, number, [(state, decisions.number(text)) for state, text in states]))
    lines = (entry_line(*k) for k in kept)
    out: list[bytes] = []
    batch: list[str] = []
    size = 0
    for line in itertools.chain(decisions.lines(), lines, (END + "\n",)):
        batch.append(line)
        size += len(line)
        if size >= piece_bytes:
            out.append("".join(batch).encode())
            batch, size = [], 0
    out.append("".join(batch).encode())
    return Body(len(decisions.numbers), None if entries is None else len(kept), tuple(out))


def table_pieces(doc: Mapping, body: Body) -> Iterator[bytes]:
    """The file of a table: ``doc`` gives the header, ``body`` (table_body) the rest."""
    yield header_lines(doc, body.decisions, body.entries).encode()
    yield from body.pieces


def render_table(doc: Mapping) -> bytes:
    """The file of a table document (``admission.table_file``; entries ``None``: a header that
    counts none, as a broken file)."""
    entries = None if doc["entries"] is None else (
        (key_digest(key), key, _entry_number(entry), ((state, decision_text(d)) for state, d in entry.items()
                                                      if state != "i"))
        for key, entry in doc["entries"].items())
    return b"".join(table_pieces(doc, table_body(entries)))


def read_table(data: bytes) -> dict:
    """The document of a table file, each decision's template complete again (ValueError: not a
    whole file of this format)."""
    lines = data.decode().split("\n")
    if len(lines) < 4 or lines[0] != TABLE_FORMAT or lines[-2:] != [END, ""]:
        raise ValueError("not a whole swapaware-admission/2 file")
    head = json.loads(lines[1])
    n_dec, n_ent = head["decisions"], head["entries"]
    if len(lines) != 2 + n_dec + n_ent + 2:
        raise ValueError("counts do not match the lines")
    decisions = [json.loads(line) for line in lines[2:2 + n_dec]]
    entries: dict[str, dict] = {}
    for line in lines[2 + n_dec:2 + n_dec + n_ent]:
        digest, key, number, refs = line.split("\t")
        if not (len(number) == 7 and number.isdigit() and _REFS.match(refs)
                and key_digest(unescape_key(key)) == digest):
            raise ValueError(f"entry line {line!r}")
        i = int(number)
        entry: dict = {"i": i}
        for ref in refs.split(" "):
            state = LETTER_STATE[ref[0]]
            entry[state] = _filled(decisions[int(ref[1:]) - 1], TableRef(head["version"], i, state))
        entries[unescape_key(key)] = entry
    return {"format": lines[0], **{k: head[k] for k in _HEADER if k in head}, "entries": entries}
