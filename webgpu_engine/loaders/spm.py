"""Pure-Python SentencePiece BPE tokenizer of GGUF vocabularies (`tokenizer.ggml.model == "llama"`:
Llama-2, Mistral, Phi-3, Gemma), as used in the browser; `native_spm` builds its `tokenizers` twin.

llama.cpp's algorithm (llm_tokenizer_spm), which follows sentencepiece: control and user-defined
token texts are matched whole first; each run of text between them gets a leading space when the
vocabulary asks for one (`add_space_prefix`: at the start and after every special token), spaces
become `▁`, and the UTF-8 characters are merged pairwise, always the adjacent pair whose joined text
is the highest-scored piece (ties: the leftmost). A character that no piece holds is spelt with its
bytes' `<0xNN>` pieces (byte fallback), else `unk`. Only normal pieces are merge targets, as in
sentencepiece: text never turns into a control or byte token. Hugging Face folders of these models
(tokenizer.json: BPE with byte_fallback) merge by their merge list's ranks instead of piece scores,
as `tokenizers` does. Standard library only.
"""
from __future__ import annotations

import heapq
import re

from ..errors import ModelFormatError, UnsupportedModelError
from .bpe import TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, VocabTokenizer, eog_ids, hf_vocab

SPACE = "\u2581"          # ▁


class SPMTokenizer(VocabTokenizer):
    """Same interface as loaders.bpe.BPETokenizer (encode, decode, token_bytes, special ids)."""

    def __init__(self, tokens: list[str], scores: list[float], token_types: list[int] | None = None, *,
                 bos_id: int | None = 1, eos_ids: list[int] | None = None, unk_id: int | None = 0,
                 pad_id: int | None = None, add_bos_token: bool = True, add_space_prefix: bool = True,
                 ranks: dict | None = None, prefix_first_only: bool = False, metaspace: bool = False,
                 newline_runs: bool = False):
        """`ranks`: {(left, right): rank} merges (tokenizer.json) in place of the scores;
        `prefix_first_only`: the space prefix only at the start of the text (Metaspace "first");
        `metaspace`: no prefix for a run that starts with a space already (Metaspace's rule);
        `newline_runs`: merge within runs of newlines and runs of other characters apart, a run of
        newlines that is a token taken whole (llama.cpp's Gemma 4 vocabulary)."""
        if len(scores) != len(tokens):
            raise ModelFormatError(f"SentencePiece vocabulary: {len(tokens)} tokens but {len(scores)} scores")
        self.tokens = list(tokens)
        self.scores = [float(s) for s in scores]
        self.token_types = list(token_types) if token_types else [TOKEN_NORMAL] * len(self.tokens)
        self.vocab: dict[str, int] = {}
        for i, t in enumerate(self.tokens):
            self.vocab.setdefault(t, i)
        # joined texts the merge loop may form: normal pieces (type 0: files that leave types out)
        self._merge_score = {t: self.scores[i] for t, i in self.vocab.items()
                             if self.token_types[i] in (TOKEN_NORMAL, 0)}
        self._bytes = [self.vocab.get(f"<0x{b:02X}>") for b in range(256)]
        self.bos_id, self.unk_id, self.pad_id = bos_id, unk_id, pad_id
        self.eos_ids = list(eos_ids or [])
        self.add_bos_token, self.add_space_prefix = add_bos_token, add_space_prefix
        self.ranks, self.prefix_first_only, self.metaspace = ranks, prefix_first_only, metaspace
        self.newline_runs = newline_runs
        self.pre = "spm"
        self._init_specials()

    @classmethod
    def from_gguf_metadata(cls, md: dict) -> "SPMTokenizer":
        """`llama` (scores) or `gemma4` (llama.cpp's Gemma 4 vocabulary: the merge list's ranks, no
        space prefix, text split into runs of newlines and runs of other characters first)."""
        model = md.get("tokenizer.ggml.model")
        if model not in ("llama", "gemma4"):
            raise UnsupportedModelError(f"not a SentencePiece vocabulary: {model!r}")
        tokens, scores = md.get("tokenizer.ggml.tokens"), md.get("tokenizer.ggml.scores")
        merges = md.get("tokenizer.ggml.merges") if model == "gemma4" else None
        if not tokens or scores is None or (model == "gemma4" and merges is None):
            raise ModelFormatError(f"GGUF metadata lacks tokenizer.ggml.tokens / scores"
                                   f"{' / merges' if model == 'gemma4' else ''}")
        ranks = None
        if merges is not None:
            ranks = {}
            for r, m in enumerate(merges):          # "left right" (llama.cpp splits at the first space after 0)
                cut = m.find(" ", 1)
                ranks.setdefault((m[:cut], m[cut + 1:]) if cut > 0 else ("", ""), r)

        def opt(key, default):
            v = md.get(f"tokenizer.ggml.{key}")
            return int(v) if v is not None and int(v) >= 0 else default
        # llama.cpp's defaults for SPM vocabularies: bos 1, eos 2, unk 0, BOS added, space prefix on
        eos = eog_ids(md) or [2]
        return cls(tokens, scores, md.get("tokenizer.ggml.token_type"), bos_id=opt("bos_token_id", 1),
                   eos_ids=eos, unk_id=opt("unknown_token_id", 0), pad_id=opt("padding_token_id", None),
                   add_bos_token=bool(md.get("tokenizer.ggml.add_bos_token", True)),
                   add_space_prefix=bool(md.get("tokenizer.ggml.add_space_prefix", model == "llama")),
                   ranks=ranks, newline_runs=model == "gemma4")

    @classmethod
    def from_tokenizer_json(cls, spec: dict, tok_cfg: dict | None = None) -> "SPMTokenizer":
        """From a Hugging Face tokenizer.json whose model is BPE with byte_fallback (Llama-2,
        Mistral, Phi-3, Gemma folders): ▁ spaces by a Prepend/Replace normalizer or a Metaspace
        pre-tokenizer."""
        model = spec.get("model") or {}
        tokens, types, ids = hf_vocab(spec, tok_cfg, lambda t: TOKEN_BYTE if len(t) == 6 and t.startswith("<0x")
                                      and t.endswith(">") else TOKEN_NORMAL)
        ranks = {}
        for r, m in enumerate(model.get("merges") or []):
            a, b = m.split(" ", 1) if isinstance(m, str) else m
            ranks.setdefault((a, b), r)
        prefix, first_only, metaspace = _space_prefix(spec)
        eos = ids.pop("eos")
        return cls(tokens, [0.0] * len(tokens), types, eos_ids=[i for i in dict.fromkeys(eos) if i is not None],
                   add_space_prefix=prefix, ranks=ranks, prefix_first_only=first_only, metaspace=metaspace, **ids)

    # ------------------------------------------------------------------ encode
    def _encode_run(self, text: str, ids: list[int], at_start: bool = True) -> None:
        """One run of text between special tokens (llama.cpp: a space before each such run)."""
        if self.add_space_prefix and (at_start or not self.prefix_first_only) \
                and not (self.metaspace and text.startswith(" ")):
            text = " " + text
        if not self.newline_runs:
            return self._merge(text, ids)
        for run in re.findall(r"[^\n]+|\n+", text):
            t = self.vocab.get(run) if run[0] == "\n" else None
            if t is not None:
                ids.append(t)
            else:
                self._merge(run, ids)

    def _merge(self, text: str, ids: list[int]) -> None:
        """The pieces of one run: merged pairwise, then byte fallback."""
        sym = list(text.replace(" ", SPACE))     # symbols: one per character, merged in place
        n = len(sym)
        nxt, prv = list(range(1, n + 1)), list(range(-1, n - 1))
        score, ranks = self._merge_score, self.ranks
        heap: list = []

        def push(a: int, b: int) -> None:
            if a >= 0 and b < n:
                if ranks is not None:            # tokenizer.json: the pair's rank in the merge list
                    r = ranks.get((sym[a], sym[b]))
                    if r is not None:
                        heapq.heappush(heap, (r, a, sym[a], sym[b]))
                    return
                s = score.get(sym[a] + sym[b])
                if s is not None:
                    heapq.heappush(heap, (-s, a, sym[a], sym[b]))
        for i in range(n - 1):
            push(i, i + 1)
        while heap:
            _, a, left, right = heapq.heappop(heap)
            b = nxt[a]
            if b >= n or sym[a] != left or sym[b] != right:     # stale: one side has merged since
                continue
            sym[a], sym[b] = left + right, ""
            nxt[a] = nxt[b]
            if nxt[b] < n:
                prv[nxt[b]] = a
            push(prv[a], a)
            push(a, nxt[a])
        i = 0
        while i < n:
            piece = sym[i]
            t = self.vocab.get(piece)
            if t is not None and self.token_types[t] not in (TOKEN_CONTROL, TOKEN_BYTE):
                ids.append(t)
            else:                                  # byte fallback
                for byte in piece.encode("utf-8"):
                    b = self._bytes[byte]
                    if b is None:
                        if self.unk_id is None:
                            raise ModelFormatError(f"SentencePiece: {piece!r} has no piece, byte or unk token")
                        b = self.unk_id
                    ids.append(b)
            i = nxt[i]

    # ------------------------------------------------------------------ decode
    def _piece_bytes(self, tok: str, ty: int) -> bytes:
        """Raw bytes of one token: `▁` as a space, `<0xNN>` as its byte, special tokens as their text."""
        if ty == TOKEN_BYTE and len(tok) == 6 and tok.startswith("<0x"):
            return bytes([int(tok[3:5], 16)])
        if ty in (TOKEN_NORMAL, 0):
            return tok.replace(SPACE, " ").encode("utf-8")
        return tok.encode("utf-8")

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """Text of ids; the space the encoder put in front is dropped again (as sentencepiece does)."""
        text = self._decode_text(ids, skip_special_tokens)
        return text[1:] if self.add_space_prefix and text.startswith(" ") else text

    @property
    def decode_strips_leading_space(self) -> bool:
        """decode() drops one leading space (the word boundary the encoder puts in front), so a
        streamed reply drops its first token's too (pipelines/detokenizer.py), as transformers'
        decode of the reply's ids does."""
        return self.add_space_prefix

    def __repr__(self) -> str:
        return f"SPMTokenizer(vocab={self.vocab_size}, add_space_prefix={self.add_space_prefix})"


def _space_prefix(spec: dict) -> tuple[bool, bool, bool]:
    """(a ▁ goes in front of the text, only at its very start, unless it starts with a space
    already) from tokenizer.json's normalizer
    (Prepend("▁") + Replace(" ", "▁"): Llama-2, Phi-3; Replace alone: Gemma) or pre-tokenizer
    (Metaspace with prepend_scheme always / first / never)."""
    def steps(node):
        if not node:
            return []
        return [s for sub in node.get("normalizers") or node.get("pretokenizers") or [] for s in steps(sub)] \
            if node.get("type") == "Sequence" else [node]
    norm, pre = steps(spec.get("normalizer")), steps(spec.get("pre_tokenizer"))
    if any(s.get("type") == "Prepend" and s.get("prepend") == SPACE for s in norm):
        return True, False, False
    for s in pre:
        if s.get("type") == "Metaspace":
            if s.get("split", False):
                raise UnsupportedModelError("tokenizer.json: a Metaspace pre-tokenizer that splits on spaces "
                                            "is not implemented")
            scheme = s.get("prepend_scheme", "always" if s.get("add_prefix_space", True) else "never")
            return scheme != "never", scheme == "first", True
    if not any(s.get("type") == "Replace" for s in norm):
        raise UnsupportedModelError("tokenizer.json: BPE with byte fallback but no ▁ space handling "
                                    "(Replace / Metaspace) is not implemented")
    return False, False, False


def native_spm(base: SPMTokenizer, specials: bool = True):
    """A `tokenizers.Tokenizer` giving the same ids: BPE with byte fallback whose merges are every
    split of a normal piece into two pieces, ranked by the joined piece's score (highest first)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers

    merges = []
    for t, s in base._merge_score.items():
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in base.vocab and b in base.vocab:
                merges.append((-s, base.vocab[t], a, b))
    merges.sort()
    unk = base.tokens[base.unk_id] if base.unk_id is not None else None
    tk = Tokenizer(models.BPE(vocab=dict(base.vocab), merges=[(a, b) for _, _, a, b in merges], unk_token=unk,
                              fuse_unk=True, byte_fallback=True))
    steps = [normalizers.Prepend(SPACE)] if base.add_space_prefix else []
    tk.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPACE)])
    tk.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
                                   + ([decoders.Strip(" ", 1, 0)] if base.add_space_prefix else []))
    specials = [base.tokens[i] for i in sorted(base.special_ids)] if specials else []
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    return tk
