"""Pure-Python GPT-2-style byte-level BPE tokenizer (GGUF `tokenizer.ggml.*`), as used in the browser.

Matches Hugging Face `tokenizers` / llama.cpp: control and user-defined tokens are matched whole in
the text; the rest is split by the model's pre-tokenizer regex (chosen by `tokenizer.ggml.pre`), each
piece's UTF-8 bytes are mapped to GPT-2's printable byte alphabet and merged by merge rank.
The stdlib `re` has no \\p{L} / \\p{N}, so those classes come from stored ranges (unicode_tables).
"""
from __future__ import annotations

import functools
import heapq
import re

from ..errors import ModelFormatError, UnsupportedModelError
from .special_text import special_pattern, split_special
from .unicode_tables import LETTER_RANGES, NUMBER_RANGES

# GGUF token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6

# Texts llama.cpp treats as end-of-generation when they are special tokens of the vocabulary.
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<EOT>", "_<EOT>",
    "<|end_of_text|>", "<|eom_id|>", "<｜end▁of▁sentence｜>", "<|return|>", "<|call|>",
})


def _eog_texts(tokens) -> frozenset:
    """EOG_TEXTS for a vocabulary: harmony's (gpt-oss: <|return|> and <|call|> end an answer) ends
    only a message with <|end|>, the answer going on in the next one (llama.cpp's rule too)."""
    if "<|return|>" in tokens and "<|call|>" in tokens:
        return EOG_TEXTS - {"<|end|>"}
    return EOG_TEXTS

# Unicode White_Space (what \s means in Oniguruma / Rust regex); Python's isspace adds \x1c-\x1f.
_WS = "\\t\\n\\x0b\\x0c\\r \\x85\\xa0\\u1680\\u2000-\\u200a\\u2028\\u2029\\u202f\\u205f\\u3000"

# Pre-tokenizer regexes in Hugging Face / llama.cpp syntax (\p{L}, \p{N}, \s as in Rust's regex);
# `to_python_regex` rewrites them for the stdlib `re`.
GPT2_PATTERN = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                  r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> (pattern, split every digit off first (HF's Digits(individual_digits=True)))
PRE_TOKENIZERS = {
    "default": (GPT2_PATTERN, False), "gpt-2": (GPT2_PATTERN, False), "gpt2": (GPT2_PATTERN, False),
    "smollm": (GPT2_PATTERN, True), "starcoder": (GPT2_PATTERN, True), "refact": (GPT2_PATTERN, True),
    "codeshell": (GPT2_PATTERN, True), "command-r": (GPT2_PATTERN, True),
    "llama-bpe": (LLAMA3_PATTERN, False), "llama3": (LLAMA3_PATTERN, False),
    "smaug-bpe": (LLAMA3_PATTERN, False), "qwen2": (QWEN2_PATTERN, False),
    "deepseek-r1-qwen": (QWEN2_PATTERN, False),
    # names llama.cpp's converter writes for cl100k vocabularies ("dbrx": DBRX's, OLMo 2's), StableLM 2,
    # Phi-2, OLMo 1 and MPT, each read with the expression llama.cpp reads it with
    "dbrx": (LLAMA3_PATTERN, False), "stablelm2": (QWEN2_PATTERN, False), "phi-2": (GPT2_PATTERN, False),
    "olmo": (GPT2_PATTERN, False), "mpt": (GPT2_PATTERN, False),
}


@functools.lru_cache(maxsize=None)
def _unicode_class(prefix: str) -> str:
    """Regex class body of every code point whose general category starts with `prefix` ('L', 'N')."""
    r = {"L": LETTER_RANGES, "N": NUMBER_RANGES}[prefix]
    return "".join(f"\\U{a:08x}" if a == b else f"\\U{a:08x}-\\U{b:08x}" for a, b in zip(r[::2], r[1::2]))


def to_python_regex(pattern: str) -> str:
    r"""Rewrite \p{L} / \p{N} (and their \P negations) and \s / \S of a Rust/Oniguruma regex into
    explicit character classes for `re`, inside or outside a [...] class."""
    out, i, in_class = [], 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\" and i + 1 < len(pattern):
            nxt = pattern[i + 1]
            if nxt in "pP" and pattern[i + 2:i + 3] == "{":
                end = pattern.index("}", i)
                name = pattern[i + 3:end]
                if name[:1] not in ("L", "N"):
                    raise UnsupportedModelError(f"pre-tokenizer regex class \\p{{{name}}} is not supported")
                body = _unicode_class(name[0]) if len(name) == 1 or name in ("Letter", "Number") else None
                if body is None:
                    raise UnsupportedModelError(f"pre-tokenizer regex class \\p{{{name}}} is not supported")
                neg = nxt == "P"
                if in_class and neg:
                    raise UnsupportedModelError("\\P{...} inside [...] is not supported")
                out.append(body if in_class else f"[{'^' if neg else ''}{body}]")
                i = end + 1
                continue
            if nxt in "sS":
                if in_class and nxt == "S":
                    raise UnsupportedModelError("\\S inside [...] is not supported")
                out.append(_WS if in_class else f"[{'^' if nxt == 'S' else ''}{_WS}]")
                i += 2
                continue
            out.append(pattern[i:i + 2])
            i += 2
            continue
        if c == "[" and not in_class:
            in_class = True
            out.append(c)
            if pattern[i + 1:i + 2] == "^":
                out.append("^")
                i += 1
        elif c == "]" and in_class:
            in_class = False
            out.append(c)
        else:
            out.append(c)
        i += 1
    return "".join(out)


@functools.lru_cache(maxsize=None)
def _compile(pattern: str) -> re.Pattern:
    return re.compile(to_python_regex(pattern))


@functools.lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (space -> 'Ġ', newline -> 'Ċ')."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def _hf_pre_tokenizer(pre: dict | None) -> tuple[str, bool]:
    """(regex, split digits first) of a tokenizer.json byte-level pre-tokenizer."""
    if not pre:
        raise UnsupportedModelError("tokenizer.json BPE without a pre_tokenizer is not supported")
    steps = pre["pretokenizers"] if pre.get("type") == "Sequence" else [pre]
    pattern, split_digits = None, False
    for st in steps:
        kind = st.get("type")
        if kind == "Digits" and st.get("individual_digits"):
            split_digits = True
        elif kind == "ByteLevel":
            if st.get("use_regex", True):
                pattern = GPT2_PATTERN
            if st.get("add_prefix_space"):
                raise UnsupportedModelError("ByteLevel(add_prefix_space=True) is not supported")
        elif kind == "Split" and "Regex" in (st.get("pattern") or {}) and st.get("behavior") == "Isolated" \
                and not st.get("invert"):
            pattern = st["pattern"]["Regex"]
        else:
            raise UnsupportedModelError(f"tokenizer.json pre-tokenizer step {st} is not supported")
    if pattern is None:
        raise UnsupportedModelError(f"tokenizer.json pre-tokenizer {pre} has no splitting regex")
    return pattern, split_digits


def eog_ids(metadata: dict) -> list[int]:
    """End-of-generation ids: eos, eot and eom from metadata, plus special tokens named like one."""
    ids = [metadata.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    out = [int(i) for i in ids if i is not None and int(i) >= 0]
    tokens = metadata.get("tokenizer.ggml.tokens") or []
    types = metadata.get("tokenizer.ggml.token_type") or []
    eog = _eog_texts(tokens)
    for i, t in enumerate(types):
        if t in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and tokens[i] in eog:
            out.append(i)
    return list(dict.fromkeys(out))


def hf_vocab(spec: dict, tok_cfg: dict | None, type_of=lambda t: TOKEN_NORMAL):
    """What a Hugging Face `tokenizer.json` (and its `tokenizer_config.json`) says of the vocabulary:
    (tokens, types, ids) with `type_of(text)` the type of a model-vocab token (added tokens: control
    if special, else user-defined) and `ids` the constructor's bos_id, unk_id, pad_id and
    add_bos_token plus `eos`, the eos_token's id (None if absent) then every control token named
    like an end of generation."""
    model = spec.get("model") or {}
    vocab: dict[str, int] = model.get("vocab") or {}
    added = spec.get("added_tokens") or []
    size = max([*vocab.values(), *(t["id"] for t in added)], default=-1) + 1
    tokens, types = [""] * size, [TOKEN_UNUSED] * size
    for t, i in vocab.items():
        tokens[i], types[i] = t, type_of(t)
    for t in added:
        tokens[t["id"]] = t["content"]
        types[t["id"]] = TOKEN_CONTROL if t.get("special") else TOKEN_USER_DEFINED
    tok_cfg = tok_cfg or {}

    def tid(key):
        v = tok_cfg.get(key)
        v = v.get("content") if isinstance(v, dict) else v
        return tokens.index(v) if v in tokens else None
    bos = tid("bos_token")
    post = spec.get("post_processor") or {}
    single = post.get("single") or []      # TemplateProcessing that starts with a special token
    first = single[0].get("SpecialToken", {}).get("id") if single else None
    add_bos = bool(tok_cfg.get("add_bos_token", False)) or (bos is not None and first == tokens[bos])
    eog = _eog_texts(tokens)
    eos = [tid("eos_token")] + [i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == TOKEN_CONTROL and t in eog]
    unk = model.get("unk_token")
    return tokens, types, dict(bos_id=bos, eos=eos, unk_id=vocab.get(unk) if unk else None,
                               pad_id=tid("pad_token"), add_bos_token=add_bos)


class VocabTokenizer:
    """What the byte-level BPE and SentencePiece tokenizers share: the vocabulary's special tokens
    (matched whole in the text, skipped by decode on request), encode's loop over the runs between
    them, the per-id byte cache and the lookups. A subclass sets tokens, token_types, vocab,
    bos_id, eos_ids, add_bos_token, calls `_init_specials()`, and supplies `_encode_run(text, ids,
    at_start)` and `_piece_bytes(token, type)`."""

    tokens: list[str]
    token_types: list[int]
    vocab: dict[str, int]
    bos_id: int | None
    eos_ids: list[int]
    add_bos_token: bool

    def _encode_run(self, text: str, ids: list[int], at_start: bool) -> None:
        raise NotImplementedError

    def _piece_bytes(self, token: str, token_type: int) -> bytes:
        raise NotImplementedError

    def _init_specials(self) -> None:
        specials = [t for t, ty in zip(self.tokens, self.token_types)
                    if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED) and t]
        self.special_ids = {self.vocab[t] for t in specials}
        self._special_re = special_pattern(specials)
        self._token_bytes: dict[int, bytes] = {}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    @property
    def eos_id(self) -> int | None:
        return self.eos_ids[0] if self.eos_ids else None

    def token_to_id(self, token: str) -> int | None:
        return self.vocab.get(token)

    def id_to_token(self, token_id: int) -> str:
        return self.tokens[token_id]

    @property
    def special_regex(self) -> re.Pattern | None:
        """Matches the texts of the special (control and user-defined) tokens, longest first."""
        return self._special_re

    def encode(self, text: str, add_special_tokens: bool = False, parse_special: bool = True) -> list[int]:
        """Token ids of `text`; with add_special_tokens, BOS is prepended when the model asks for it.
        parse_special=False: special-token texts in `text` are ordinary text (user content)."""
        ids: list[int] = []
        if add_special_tokens and self.add_bos_token and self.bos_id is not None:
            ids.append(self.bos_id)
        for start, piece, special in split_special(text, self._special_re if parse_special else None):
            if special:
                ids.append(self.vocab[piece])
            else:
                self._encode_run(piece, ids, start == 0)
        return ids

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (cached; the subclass's `_piece_bytes` spells them)."""
        b = self._token_bytes.get(token_id)
        if b is None:
            if not 0 <= token_id < len(self.tokens):
                raise ValueError(f"token id {token_id} is outside the vocabulary (size {len(self.tokens)})")
            b = self._token_bytes[token_id] = self._piece_bytes(self.tokens[token_id], self.token_types[token_id])
        return b

    def _decode_text(self, ids, skip_special_tokens: bool) -> str:
        parts = [self.token_bytes(int(i)) for i in ids
                 if not (skip_special_tokens and int(i) in self.special_ids)]
        return b"".join(parts).decode("utf-8", "replace")


def _merge_scan(parts: list[str], ranks: dict) -> list[str]:
    """GPT-2's loop: merge every occurrence of the best-ranked pair, left to right, until none is left.
    O(n^2) in the piece length, fastest for the short pieces of ordinary text."""
    while len(parts) > 1:
        best, best_rank = -1, None
        for i in range(len(parts) - 1):
            r = ranks.get((parts[i], parts[i + 1]))
            if r is not None and (best_rank is None or r < best_rank):
                best, best_rank = i, r
        if best_rank is None:
            break
        a, b = parts[best], parts[best + 1]
        merged, i = [], 0
        while i < len(parts):
            if i < len(parts) - 1 and parts[i] == a and parts[i + 1] == b:
                merged.append(a + b)
                i += 2
            else:
                merged.append(parts[i])
                i += 1
        parts = merged
    return parts


def _merge_heap(parts: list[str], ranks: dict) -> list[str]:
    """The same merges in `tokenizers`' order (lowest rank, then leftmost) with a heap and a linked
    list: O(n log n), so one long run of letters (pasted data) cannot stall encoding."""
    sym: list[str | None] = list(parts)
    n = len(sym)
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    prv = list(range(-1, n - 1))
    heap = [(r, i, sym[i], sym[i + 1]) for i in range(n - 1)
            if (r := ranks.get((sym[i], sym[i + 1]))) is not None]
    heapq.heapify(heap)
    while heap:
        _, i, a, b = heapq.heappop(heap)
        j = nxt[i]
        if sym[i] != a or j < 0 or sym[j] != b:      # stale: a neighbour was merged meanwhile
            continue
        sym[i], sym[j] = a + b, None
        k = nxt[j]
        nxt[i] = k
        if k >= 0:
            prv[k] = i
            r = ranks.get((sym[i], sym[k]))
            if r is not None:
                heapq.heappush(heap, (r, i, sym[i], sym[k]))
        p = prv[i]
        if p >= 0:
            r = ranks.get((sym[p], sym[i]))
            if r is not None:
                heapq.heappush(heap, (r, p, sym[p], sym[i]))
    return [t for t in sym if t is not None]


class BPETokenizer(VocabTokenizer):
    """Byte-level BPE. `encode(text)` adds no BOS (see `add_bos_token`); special tokens in the text
    are matched whole. `token_bytes(id)` gives the raw bytes of one token (a token may hold part of
    a UTF-8 character), for incremental detokenizers."""

    def __init__(self, tokens: list[str], merges: list[str], token_types: list[int] | None = None, *,
                 pre: str = "default", bos_id: int | None = None, eos_ids: list[int] | None = None,
                 unk_id: int | None = None, pad_id: int | None = None, add_bos_token: bool = False,
                 pattern: str | None = None, split_digits: bool = False, ignore_merges: bool = False,
                 cache_size: int = 65536):
        if pattern is None and pre not in PRE_TOKENIZERS:
            raise UnsupportedModelError(f"BPE pre-tokenizer {pre!r} is not implemented; known: "
                                        f"{sorted(PRE_TOKENIZERS)}")
        self.tokens = list(tokens)
        self.token_types = list(token_types) if token_types else [TOKEN_NORMAL] * len(self.tokens)
        self.vocab = {t: i for i, t in enumerate(self.tokens)}
        self.ranks: dict[tuple[str, str], int] = {}
        for r, m in enumerate(merges):
            if isinstance(m, str):               # GGUF and older tokenizer.json: "left right"
                a, sep, b = m.partition(" ")
                if not sep:
                    raise ModelFormatError(f"BPE merge #{r} {m!r} is not 'left right'")
            else:                                # newer tokenizer.json: ["left", "right"]
                a, b = m
            self.ranks.setdefault((a, b), r)
        self.ignore_merges = ignore_merges
        self.pre = pre
        self.pattern, self.split_digits = PRE_TOKENIZERS[pre] if pattern is None else (pattern, split_digits)
        self.bos_id, self.unk_id, self.pad_id = bos_id, unk_id, pad_id
        self.eos_ids = list(eos_ids or [])
        self.add_bos_token = add_bos_token
        self._byte_enc = bytes_to_unicode()
        self._byte_dec = {c: b for b, c in self._byte_enc.items()}
        self._init_specials()
        self._bpe = functools.lru_cache(maxsize=cache_size)(self._bpe_word)

    @classmethod
    def from_gguf_metadata(cls, md: dict) -> "BPETokenizer":
        model = md.get("tokenizer.ggml.model")
        if model != "gpt2":
            raise UnsupportedModelError(
                f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
        if "tokenizer.ggml.tokens" not in md or "tokenizer.ggml.merges" not in md:
            raise ModelFormatError("GGUF metadata lacks tokenizer.ggml.tokens / tokenizer.ggml.merges")

        def opt(key):
            v = md.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None else None
        return cls(md["tokenizer.ggml.tokens"], md["tokenizer.ggml.merges"], md.get("tokenizer.ggml.token_type"),
                   pre=str(md.get("tokenizer.ggml.pre", "default")), bos_id=opt("bos_token_id"),
                   eos_ids=eog_ids(md), unk_id=opt("unknown_token_id"), pad_id=opt("padding_token_id"),
                   add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", False)))

    @classmethod
    def from_tokenizer_json(cls, spec: dict, tok_cfg: dict | None = None) -> "BPETokenizer":
        """From a Hugging Face `tokenizer.json` (byte-level BPE) and its `tokenizer_config.json`."""
        model = spec.get("model") or {}
        tokens, types, ids = hf_vocab(spec, tok_cfg)
        pattern, split_digits = _hf_pre_tokenizer(spec.get("pre_tokenizer"))
        eos = ids.pop("eos")
        return cls(tokens, model.get("merges") or [], types, pre="tokenizer.json", pattern=pattern,
                   split_digits=split_digits, eos_ids=[i for i in eos if i is not None],
                   ignore_merges=bool(model.get("ignore_merges", False)), **ids)

    # ------------------------------------------------------------------ encode
    def pre_tokenize(self, text: str) -> list[str]:
        """Split text without special tokens into the pieces BPE merges within."""
        regex = _compile(self.pattern)
        chunks = _compile(r"(\p{N})").split(text) if self.split_digits else [text]
        out: list[str] = []
        for chunk in chunks:
            if chunk:
                out.extend(regex.findall(chunk))
        return out

    def _bpe_word(self, word: str) -> tuple[int, ...]:
        """Ids of one pre-tokenized piece (cached per piece: prompts repeat words a lot)."""
        enc = self._byte_enc
        parts = [enc[b] for b in word.encode("utf-8")]
        if self.ignore_merges:                   # Llama-3 style: a whole piece in the vocab wins
            i = self.vocab.get("".join(parts))
            if i is not None:
                return (i,)
        parts = _merge_heap(parts, self.ranks) if len(parts) > 48 else _merge_scan(parts, self.ranks)
        ids = []
        for p in parts:
            i = self.vocab.get(p)
            if i is None:
                if self.unk_id is None:
                    raise ModelFormatError(f"BPE symbol {p!r} is not in the vocabulary and there is no unk")
                i = self.unk_id
            ids.append(i)
        return tuple(ids)

    def _encode_run(self, text: str, ids: list[int], at_start: bool = True) -> None:
        """One run of text between special tokens (where it stands does not matter to BPE)."""
        bpe = self._bpe
        for piece in self.pre_tokenize(text):
            ids.extend(bpe(piece))

    # ------------------------------------------------------------------ decode
    def _piece_bytes(self, tok: str, ty: int) -> bytes:
        """Raw bytes of one token (special tokens: their text)."""
        if ty in (TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNKNOWN, TOKEN_UNUSED):
            return tok.encode("utf-8")
        if ty == TOKEN_BYTE and len(tok) == 6 and tok.startswith("<0x"):
            return bytes([int(tok[3:5], 16)])
        dec = self._byte_dec
        try:
            return bytes(dec[c] for c in tok)
        except KeyError:                         # not in the byte alphabet: take the text as is
            return tok.encode("utf-8")

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        return self._decode_text(ids, skip_special_tokens)

    def __repr__(self) -> str:
        return f"BPETokenizer(vocab={self.vocab_size}, merges={len(self.ranks)}, pre={self.pre!r})"
