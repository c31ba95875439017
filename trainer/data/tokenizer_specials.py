"""Special tokens: the conventional spellings of BOS and EOS, and what the files of a Hugging
Face tokenizer folder say about them. The lowest of the tokenizer modules (the backends in
trainer.data.tokenizer_backends build on it), so the tokenizer error is defined here.

A tokenizer.json need not hold every special token its folder names. A bare byte-level BPE may
come with a tokenizer_config.json whose added_tokens_decoder names <|begin_of_text|> at 128000
and <|end_of_text|> at 128001 (torchtitan's test tokenizer is one). Loading such a folder does
what Hugging Face transformers does: the tokens that tokenizer_config.json (added_tokens_decoder,
bos_token, eos_token) or special_tokens_map.json name and tokenizer.json lacks are added, in the
order of the ids the config gives. The `tokenizers` library numbers added tokens on from the end
of the vocabulary, so a token gets the id the config gives when that is the next free one, and
the next free one otherwise: 128000 after a vocabulary of 2002 ids would leave 125,998 ids
without a token, and need an embedding that large. A folder that names no end-of-sequence token
(documents are separated by it) gets <|end_of_text|>, with <|begin_of_text|> before it when it
names no BOS either. Every token added is reported, one line each.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from tokenizers import AddedToken

LLAMA3_BOS, LLAMA3_EOS = "<|begin_of_text|>", "<|end_of_text|>"
# Conventional spellings of BOS and EOS (pairs: position i of one goes with position i of the
# other), for a tokenizer.json that names them nowhere else.
BOS_SPELLINGS = (LLAMA3_BOS, "<s>", "<|startoftext|>", "<bos>")
EOS_SPELLINGS = (LLAMA3_EOS, "</s>", "<|endoftext|>", "<eos>")
BESIDE = ("tokenizer_config.json", "special_tokens_map.json")  # read in this order: the first to name a role wins
CONVENTION = ""  # `where` of a token no file names: added by convention
ROLE_NAMES = {"bos": "beginning-of-sequence", "eos": "end-of-sequence"}


class TokenizerError(ValueError):
    """A problem with a tokenizer file or its training input; the message names the file."""


def brief(text, limit: int = 300) -> str:
    """A library's or a file's text as a message quotes it: one line, cut short (a tokenizer file
    may hold a megabyte-long token, which a parser's error repeats)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + " ..."


@dataclass(frozen=True)
class Declared:
    """A token the folder's files name: its spelling, the id a config gives it (None: none given),
    its AddedToken flags, and the file that names it (CONVENTION: none does)."""

    content: str
    config_id: int | None
    flags: dict
    where: str


@dataclass
class NamedSpecials:
    """roles: {"bos" / "eos": (spelling or None for none, the file saying so)}; declared: the
    tokens that must be in the tokenizer, in the order they are added when missing."""

    roles: dict = field(default_factory=dict)
    declared: list = field(default_factory=list)


def named_specials(path: str, spec: dict) -> NamedSpecials:
    """The special tokens of the tokenizer.json at `path` (parsed: `spec`) and the files beside it."""
    configs = _read_beside(path)
    named = NamedSpecials()
    for where, config in configs:
        for role in ("bos", "eos"):
            if role not in named.roles and f"{role}_token" in config:
                named.roles[role] = (_spelling(config[f"{role}_token"], where, role), where)
    for role, spelling in _specials_shown(spec).items():
        named.roles.setdefault(role, (spelling, path))
    if "eos" not in named.roles:  # a key set to null is a choice; only a role nobody names is supplied
        bos = named.roles.get("bos", (None, ""))[0]
        pair = BOS_SPELLINGS.index(bos) if bos in BOS_SPELLINGS else 0
        named.roles["eos"] = (EOS_SPELLINGS[pair], CONVENTION)
        if "bos" not in named.roles:
            named.roles["bos"] = (LLAMA3_BOS, CONVENTION)
    for where, config in configs:
        named.declared += _added_tokens_decoder(config, where)
    for role in ("bos", "eos"):
        spelling, where = named.roles.get(role, (None, ""))
        if spelling is not None:
            flags = next((config.get(f"{role}_token") for w, config in configs if w == where), None)
            named.declared.append(Declared(spelling, None, flags if isinstance(flags, dict) else {}, where))
    seen: set[str] = set()  # the first mention of a token decides where it is said to come from
    named.declared = [d for d in named.declared if not (d.content in seen or seen.add(d.content))]
    return named


def add_missing_specials(tok, path: str, named: NamedSpecials) -> tuple[list[list], list[str]]:
    """Add the declared tokens the `tokenizers` Tokenizer `tok` lacks. Returns ([spelling, id]
    of each token added, one line per token added or chosen by convention); a config that gives
    a token of the file another id is refused (the two files are not of one tokenizer)."""
    added, notes = [], []
    role_of = {spelling: role for role, (spelling, _) in named.roles.items() if spelling}
    for token in named.declared:
        have = tok.token_to_id(token.content)
        if have is not None:
            if token.config_id is not None and have != token.config_id:
                raise TokenizerError(
                    f"{token.where} gives {token.content!r} id {token.config_id}, but {path} has it at id {have}: "
                    f"the two files are not of one tokenizer; use the {Path(token.where).name} that came with this "
                    "tokenizer.json, or remove the entry")
            if token.where == CONVENTION:
                role = role_of[token.content]
                notes.append(f"{path} names no {ROLE_NAMES[role]} token, nor does a {' or '.join(BESIDE)} beside it: "
                             f"using its {token.content!r} (id {have}) as {role.upper()}")
            continue
        next_id = max(tok.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        special = bool(token.flags.get("special", True))
        new = AddedToken(token.content, single_word=bool(token.flags.get("single_word", False)),
                         lstrip=bool(token.flags.get("lstrip", False)), rstrip=bool(token.flags.get("rstrip", False)),
                         normalized=bool(token.flags.get("normalized", not special)), special=special)
        (tok.add_special_tokens if special else tok.add_tokens)([new])
        token_id = tok.token_to_id(token.content)
        if token_id is None or token_id < next_id:  # the library numbers on from the count of its ids
            raise TokenizerError(f"{path}: adding {token.content!r} gave it the id {token_id} of another token: the "
                                 f"ids of its vocabulary are not 0..{next_id - 1} without gaps")
        added.append([token.content, token_id])
        role = role_of.get(token.content)
        notes.append(f"added {token.content!r}{f' ({role.upper()})' if role else ''} to {path} at id {token_id}: "
                     + _why(token, role, tok, token_id))
    return added, notes


def _why(token: Declared, role: str | None, tok, token_id: int) -> str:
    if token.where == CONVENTION:
        return f"no {ROLE_NAMES[role]} token is named by it or by a {' or '.join(BESIDE)} beside it"
    if token.config_id is None or token.config_id == token_id:
        return f"{token.where} names it"
    holder = tok.id_to_token(token.config_id)
    if holder is not None and holder != token.content:
        return f"{token.where} names it at id {token.config_id}, which is {holder!r} in tokenizer.json"
    return (f"{token.where} names it at id {token.config_id}; added tokens take the next free id after the "
            "vocabulary")


def _read_beside(path: str) -> list[tuple[str, dict]]:
    """(file, content) of the files beside tokenizer.json that name special tokens, in BESIDE's order."""
    found = []
    for name in BESIDE:
        beside = Path(path).parent / name
        if beside.is_file():
            try:
                config = json.loads(beside.read_bytes())
            except (ValueError, RecursionError) as e:  # ValueError: JSON, UTF-8, an int of 5000 digits
                raise TokenizerError(f"{beside} is not valid JSON ({brief(e)})") from None
            if not isinstance(config, dict):
                raise TokenizerError(f"{beside} is not a JSON object")
            found.append((str(beside), config))
    return found


def _added_tokens_decoder(config: dict, where: str) -> list[Declared]:
    """tokenizer_config.json's added_tokens_decoder ({"id": {"content": ..., flags}}), by id."""
    entries = config.get("added_tokens_decoder") or {}
    if not isinstance(entries, dict):
        raise TokenizerError(f'{where}: added_tokens_decoder is not an object of "id": {{"content": ...}} entries')
    declared = []
    for key, entry in entries.items():
        if not (key.isdigit() and isinstance(entry, dict) and isinstance(entry.get("content"), str)):
            raise TokenizerError(f"{where}: added_tokens_decoder entry {key!r} is not an integer id mapped to "
                                 '{"content": "<token>", ...}')
        declared.append(Declared(entry["content"], int(key), entry, where))
    return sorted(declared, key=lambda d: d.config_id)


def _spelling(token, where: str, role: str) -> str | None:
    """A special token as the files beside tokenizer.json write it: a string, null, or {"content": ...}."""
    if token is None or isinstance(token, str):
        return token
    if isinstance(token, dict) and isinstance(token.get("content"), str):
        return token["content"]
    raise TokenizerError(f'{where}: {role}_token is {token!r}; give a string, null or {{"content": "<token>"}}')


def _specials_shown(spec: dict) -> dict:
    """BOS and EOS as tokenizer.json shows them: the special tokens its post-processor puts
    before and after a sequence, else special added tokens of a conventional spelling."""
    shown: dict = {}
    processors = [spec.get("post_processor") or {}]
    processors += processors[0].get("processors", [])  # a Sequence of processors
    for processor in processors:
        if processor.get("type") == "TemplateProcessing":
            template = processor.get("single", [])
            where = next((i for i, item in enumerate(template) if "Sequence" in item), len(template))
            before = [item["SpecialToken"]["id"] for item in template[:where] if "SpecialToken" in item]
            after = [item["SpecialToken"]["id"] for item in template[where:] if "SpecialToken" in item]
            if before:
                shown["bos"] = before[0]
            if after:
                shown["eos"] = after[-1]
        elif processor.get("type") in ("RobertaProcessing", "BertProcessing"):
            shown.update(bos=processor["cls"][0], eos=processor["sep"][0])
    added = {token["content"] for token in spec.get("added_tokens", []) if token.get("special")}
    for role, spellings in (("bos", BOS_SPELLINGS), ("eos", EOS_SPELLINGS)):
        if role not in shown:
            found = next((s for s in spellings if s in added), None)
            if found:
                shown[role] = found
    return shown
