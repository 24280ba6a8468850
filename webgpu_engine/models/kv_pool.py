"""The paged KV cache's bookkeeping: a pool of fixed-size blocks, per-sequence block tables, reference
counts, prefix sharing through a hash chain of full blocks, LRU eviction and preemption (no GPU).

A block holds the K and V rows of `block_size` consecutive tokens of one sequence in every layer
(the GPU side, kernels/attention_paged.py, keeps one buffer per layer shaped
(n_blocks, block_size, Hkv, D) and reads it through the block tables built here).

Prefix sharing: once a block is full and its KV written by prefill, it is registered under
hash(parent block's hash, its tokens), so the key names the whole token prefix up to its end (a
block holding a row a decode step wrote is never shared: the decode kernels round otherwise than the
prefill's, and a shared row must be what a cold prefill writes, bit for bit). A new
sequence walks its prompt's full blocks through that chain and takes every cached block it finds
(reference count + 1) instead of recomputing them. Only full blocks are shared and a full block is
never written again (a sequence appends only into its own last, partial block), so no copy-on-write
is needed: `n > 1` choices or a forked conversation share the full blocks and each recomputes at
most block_size - 1 tokens of its partial tail.

Rows past the shared blocks (`partial`): a prompt whose next tokens begin a cached block's (the same
parent key: the same prefix before it) but leave it before its end, as prompts after one chat
template's system text do, takes that block's first matching rows by a copy into a block of its own
(`take_copy`: the scheduler records it before the sequence's first forward; the source block is held
until then), so a prompt recomputes only what no cached block holds, to the token, as a conversation's
own cache did. A copied row is the row a prefill of those tokens writes (prefill is row-invariant).
A freed sequence's last, partly filled block is cached too for its prefilled rows (`_keep_tail`),
so the same prompt again, or a conversation's next turn, copies its tail rather than computing it.

A block is in exactly one state: free (never held or evicted), referenced (ref > 0, in one or, when
cached and shared, several block tables) or cached-idle (ref 0, hash kept, in the LRU list). Allocation
takes free blocks first, then evicts the least recently used cached-idle block. When even that is
not enough, the scheduler preempts the newest sequence (`preempt_newest`): its blocks are released
(its full blocks stay cached, so its recomputation later is mostly prefix hits).

A scheduler's calls: admit with `add_sequence(id, prompt)` (-> cached prompt tokens, where prefill
starts); per prefill chunk `reserve(id, end)`, write K/V at `slots(id, start, n)`, then
`append_tokens(id, chunk)`; per decode step `reserve(id, n + 1)` for every running sequence,
`decode_inputs(ids, ...)` for the kernels, then `append_tokens(id, [token fed], decoded=True)`; `free(id)` when done;
`reserve_or_preempt` where the pool may run out. A verify step (speculation) reserves its guesses'
rows too, feeds them through `decode_rows`, appends the accepted ones and `trim`s the rest.

A ring (WebLLM's sliding window with sinks; `ring_rows` > 0): each sequence holds at most ring_rows
rows (the window plus one forward's rows, a whole number of blocks), positions 0 .. ring_rows - 1 in
place and later ones at row sinks + (pos - sinks) % (ring_rows - sinks), so the sink rows stay and
the rest of its blocks is written over as positions grow (kernels/attention_paged.py's ring_row).
Blocks that are written over are never shared: a ring pool shares no prefix.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

__all__ = ["KVPool", "PoolExhaustedError", "block_hash", "SKIP_SLOT"]

SKIP_SLOT = 0xFFFFFFFF      # a row the KV write leaves out (kernels/attention_paged.py's value)


class PoolExhaustedError(RuntimeError):
    """Not enough free or evictable blocks: the scheduler preempts a sequence and retries."""


def block_hash(parent: bytes, tokens) -> bytes:
    """The key of a full block: sha256 over its parent's key and its token ids (a 32-byte digest,
    so two different prefixes never share a key in practice; Python's hash() would risk a wrong KV)."""
    return hashlib.sha256(parent + array("I", tokens).tobytes()).digest()


ROOT = b""          # the parent key of a sequence's first block
PART = b"p"         # prefix of a cached tail's key (its first rows only): never equal to a full block's


@dataclass
class _Seq:
    blocks: list = field(default_factory=list)      # block table: physical block per logical block
    tokens: list = field(default_factory=list)      # tokens whose KV is written (or reused)
    hashes: list = field(default_factory=list)      # keys of the full blocks, in order
    order: int = 0                                   # admission counter (preemption picks the max)
    exact: int | None = None                         # tokens before the first decoded one (None: all prefilled)
    root: bytes = b""                                # parent key of its first block (ROOT; a LoRA adapter's own)
    copy: tuple | None = None                        # (source block, its block, rows) not yet copied


class KVPool:
    """Blocks 0 .. n_blocks-1 of block_size tokens; sequences are any hashable id. `share` False: no
    block is registered for sharing, so every block is private to its sequence and `truncate` may
    cut anywhere (a draft model's cache, whose guessed rows are taken back). `ring_rows` > 0 (a
    multiple of block_size) with `ring_sinks`: each sequence's table is a ring (no sharing). `partial`:
    a prompt also takes the matching first rows of a cached block past its shared ones (by a copy)."""

    def __init__(self, n_blocks: int, block_size: int, share: bool = True, ring_rows: int = 0, ring_sinks: int = 0,
                 partial: bool = False):
        if n_blocks < 1 or block_size < 1:
            raise ValueError(f"need n_blocks >= 1 and block_size >= 1, got {n_blocks}, {block_size}")
        if ring_rows and (ring_rows % block_size or not 0 <= ring_sinks < ring_rows):
            raise ValueError(f"a ring of {ring_rows} rows with {ring_sinks} sinks over blocks of {block_size}")
        self.n_blocks, self.block_size = int(n_blocks), int(block_size)
        self.ring_rows, self.ring_sinks = int(ring_rows), int(ring_sinks)
        self.share = bool(share) and not ring_rows
        self.partial = bool(partial) and self.share
        self.ref = [0] * self.n_blocks
        self._free = list(range(self.n_blocks - 1, -1, -1))     # pop() hands out low ids first
        self._idle: OrderedDict[int, None] = OrderedDict()      # cached, ref 0; first = least recent
        self._cache: dict[bytes, int] = {}                       # key -> block
        self._key_of: dict[int, bytes] = {}                      # block -> key (cached blocks)
        self._children: dict[bytes, dict[int, tuple]] = {}     # parent key -> {cached block: its tokens}
        self._parent_of: dict[int, bytes] = {}
        self._seqs: dict = {}
        self._counter = 0
        self.stats = {"hit_tokens": 0, "miss_tokens": 0, "evictions": 0, "preemptions": 0, "copied_tokens": 0}

    # ------------------------------------------------------------------ queries
    @property
    def n_free(self) -> int:
        """Blocks an allocation can take now: free plus cached-idle (evictable)."""
        return len(self._free) + len(self._idle)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def block_table(self, seq_id) -> list:
        return list(self._seqs[seq_id].blocks)

    def num_tokens(self, seq_id) -> int:
        return len(self._seqs[seq_id].tokens)

    def tokens(self, seq_id) -> list:
        """The tokens whose KV seq_id holds (a copy)."""
        return list(self._seqs[seq_id].tokens)

    def _blocks_for(self, n_tokens: int) -> int:
        """Blocks a sequence of n_tokens positions holds (a ring: at most its rows')."""
        n = int(n_tokens)
        return -(-(min(n, self.ring_rows) if self.ring_rows else n) // self.block_size)

    def fits(self, n_tokens: int, spare: int = 0) -> bool:
        """Whether the free blocks hold a sequence of n_tokens (as if none were cached) and `spare`
        blocks more."""
        return self.n_free >= self._blocks_for(n_tokens) + spare

    def blocks_needed(self, seq_id, n_tokens: int) -> int:
        """New blocks `seq_id` needs to hold n_tokens in all."""
        return max(0, self._blocks_for(n_tokens) - len(self._seqs[seq_id].blocks))

    def row(self, pos: int) -> int:
        """The table row of position pos: itself, or a ring's row for it past the ring's end."""
        r, sinks = self.ring_rows, self.ring_sinks
        return pos if not r or pos < r else sinks + (pos - sinks) % (r - sinks)

    def slots(self, seq_id, start: int, n: int) -> list:
        """Physical token rows (block * block_size + offset) of positions start .. start+n-1: where
        the KV write kernel scatters them."""
        s, bs = self._seqs[seq_id], self.block_size
        if start < 0 or self._blocks_for(start + n) > len(s.blocks) or (self.ring_rows and n > self.ring_rows):
            raise ValueError(f"positions {start}..{start + n - 1} are outside the {len(s.blocks)} blocks "
                             f"of sequence {seq_id!r}")
        rows = [self.row(p) for p in range(start, start + n)]
        return [s.blocks[r // bs] * bs + r % bs for r in rows]

    def block_keys(self, seq_id) -> list:
        """The keys of seq_id's full blocks, in order (a copy)."""
        return list(self._seqs[seq_id].hashes)

    def sequences_newest_first(self) -> list:
        return sorted(self._seqs, key=lambda k: -self._seqs[k].order)

    def decode_inputs(self, seq_ids, max_seqs: int, max_blocks: int, ahead: int = 0) -> dict:
        """The u32 inputs of one batched decode step (kernels/attention_paged.py) for seq_ids, whose
        next token (position num_tokens + ahead: `ahead` steps are in flight, not yet recorded) has
        a reserved slot: positions and slots of that token, lens (keys incl. it) and tables
        (max_seqs x max_blocks, flat); idle rows past len(seq_ids) get lens 0, slot SKIP_SLOT.
        After the step, append_tokens(seq, [the token fed]) records its KV."""
        return self.decode_rows([(i, len(self._seqs[i].tokens) + ahead) for i in seq_ids], max_seqs, max_blocks)

    def decode_rows(self, rows, max_rows: int, max_blocks: int) -> dict:
        """decode_inputs for rows (seq_id, position), each with a reserved slot: a sequence may have
        several rows at consecutive positions (a verify step's guesses), each reading the keys up
        to its own position, those the rows before it write in the same step included."""
        if len(rows) > max_rows:
            raise ValueError(f"{len(rows)} rows exceed max_rows={max_rows}")
        idle = max_rows - len(rows)
        out = {"positions": [], "slots": [], "lens": [], "tables": []}
        for seq_id, n in rows:
            s = self._seqs[seq_id]
            if len(s.blocks) > max_blocks:
                raise ValueError(f"sequence {seq_id!r} holds {len(s.blocks)} blocks, tables have {max_blocks}")
            out["positions"].append(n)
            out["slots"] += self.slots(seq_id, n, 1)
            out["lens"].append(n + 1)
            out["tables"] += s.blocks + [0] * (max_blocks - len(s.blocks))
        out["positions"] += [0] * idle
        out["slots"] += [SKIP_SLOT] * idle
        out["lens"] += [0] * idle
        out["tables"] += [0] * (idle * max_blocks)
        return out

    # ------------------------------------------------------------------ lifecycle
    def add_sequence(self, seq_id, prompt, root: bytes = ROOT, reusable=None, rows: bool = True) -> int:
        """Admits seq_id with its prompt token ids; returns how many leading prompt tokens are
        already cached (a multiple of block_size, at most len(prompt) - 1 so that the last token
        is still computed and gives logits). Those blocks now belong to seq_id's table too. `root`: the
        parent key of the first block, so that only sequences of the same root share blocks (the rows
        of a LoRA adapter differ from the base's). `reusable` (key -> bool): a cached prefix may end
        only at a block whose key it accepts (a model with recurrent states: where a state snapshot
        is kept, models/recurrent_snapshots.py). `rows` False: no rows past the shared blocks (`partial`)."""
        if seq_id in self._seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the pool")
        self._counter += 1
        s = self._seqs[seq_id] = _Seq(order=self._counter, root=root)
        bs, parent, chain = self.block_size, root, []
        for i in range((len(prompt) - 1) // bs if prompt else 0):
            key = block_hash(parent, prompt[i * bs:(i + 1) * bs])
            b = self._cache.get(key)
            if b is None:
                break
            chain.append((key, b))
            parent = key
        if reusable is not None:
            while chain and not reusable(chain[-1][0]):
                chain.pop()
        for i, (key, b) in enumerate(chain):
            toks = prompt[i * bs:(i + 1) * bs]
            self._take(b)
            s.blocks.append(b)
            s.tokens.extend(toks)
            s.hashes.append(key)
        self.stats["hit_tokens"] += len(s.tokens)
        if self.partial and rows and reusable is None:
            self._take_rows(s, prompt, chain[-1][0] if chain else root)
        self.stats["miss_tokens"] += len(prompt) - len(s.tokens)
        return len(s.tokens)

    def _take_rows(self, s: _Seq, prompt, parent: bytes) -> None:
        """`partial`: the cached block after `parent` whose first tokens match most of the prompt's
        next ones (leaving its last token to compute) gives them: a block of s's own for its rows
        copied from that one (held until `take_copy`)."""
        at = len(s.tokens)
        want = prompt[at:min(at + self.block_size, len(prompt) - 1)]
        best, src = 0, None
        for b, toks in self._children.get(parent, {}).items():
            m = 0
            while m < len(want) and m < len(toks) and toks[m] == want[m]:
                m += 1
            if m > best:
                best, src = m, b
        if src is None or self.n_free < 1 + (self.ref[src] == 0):
            return
        self._take(src)                     # held (not evicted) until its rows are copied
        dst = self._allocate()
        s.blocks.append(dst)
        s.tokens.extend(int(t) for t in want[:best])
        s.copy = (src, dst, best)
        self.stats["copied_tokens"] += best

    def take_copy(self, seq_id) -> tuple | None:
        """(source block, destination block, rows) that seq_id's first rows need copied before its
        first forward (the caller records the copy into that forward's batch, ahead of it), or None.
        The source is released: work recorded after the copy may write it."""
        s = self._seqs[seq_id]
        cp, s.copy = s.copy, None
        if cp is not None:
            self._release(cp[0])
        return cp

    def reserve(self, seq_id, n_tokens: int) -> list:
        """Makes seq_id's table long enough for n_tokens tokens in all; returns the new blocks.
        Raises PoolExhaustedError (allocating nothing) when the pool cannot supply them."""
        need = self.blocks_needed(seq_id, n_tokens)
        if need > self.n_free:
            raise PoolExhaustedError(f"sequence {seq_id!r} needs {need} blocks, {self.n_free} available")
        new = [self._allocate() for _ in range(need)]
        self._seqs[seq_id].blocks.extend(new)
        return new

    def append_tokens(self, seq_id, tokens, decoded: bool = False) -> None:
        """Records that the KV of `tokens` (the next positions of seq_id) is written (`decoded`: by
        a decode step); every block this fills with prefilled rows only is registered for sharing
        (unless an equal block is already cached)."""
        s, bs = self._seqs[seq_id], self.block_size
        if self._blocks_for(len(s.tokens) + len(tokens)) > len(s.blocks):
            raise ValueError(f"sequence {seq_id!r}: {len(s.tokens) + len(tokens)} tokens exceed its "
                             f"{len(s.blocks)} blocks; reserve first")
        if decoded and s.exact is None:
            s.exact = len(s.tokens)
        s.tokens.extend(int(t) for t in tokens)
        while not self.ring_rows and (len(s.hashes) + 1) * bs <= len(s.tokens):
            i = len(s.hashes)
            key = block_hash(s.hashes[-1] if s.hashes else s.root, s.tokens[i * bs:(i + 1) * bs])
            s.hashes.append(key)
            b = s.blocks[i]
            if not self.share or (s.exact is not None and (i + 1) * bs > s.exact):
                continue                    # holds decoded rows (or nothing is shared): private
            if key not in self._cache:      # a duplicate of a cached block stays private
                self._register(b, key, s.hashes[-2] if len(s.hashes) > 1 else s.root, s.tokens[i * bs:(i + 1) * bs])

    def trim(self, seq_id, n_tokens: int) -> None:
        """Gives back the reserved blocks seq_id needs no more to hold n_tokens (at least its written
        tokens): a verify step's rejected rows. Those blocks were never written: they go back free."""
        s = self._seqs[seq_id]
        keep = self._blocks_for(max(int(n_tokens), len(s.tokens)))
        while len(s.blocks) > keep:
            self._release(s.blocks.pop())

    def truncate(self, seq_id, n_tokens: int) -> None:
        """Forgets seq_id's tokens past the first n_tokens (their rows are written again by position)
        and gives back the blocks past them. Only where no kept block is shared (`share` False, or a
        cut at a shared block's end): a shared block's rows must never change."""
        s, bs = self._seqs[seq_id], self.block_size
        n = max(0, min(int(n_tokens), len(s.tokens)))
        if n % bs and n // bs < len(s.blocks) and s.blocks[n // bs] in self._key_of:
            raise ValueError(f"sequence {seq_id!r}: position {n} is inside a shared block")
        del s.tokens[n:]
        del s.hashes[n // bs:]
        if s.exact is not None and s.exact >= n:     # every kept row was prefilled
            s.exact = None
        while len(s.blocks) > self._blocks_for(n):
            self._release(s.blocks.pop())

    def free(self, seq_id) -> None:
        """Releases seq_id's blocks. Cached blocks whose count drops to 0 become evictable, the
        table's tail first so that a chain's head (the likeliest to be shared) is evicted last."""
        s = self._seqs.pop(seq_id)
        if self.partial and s.copy is None:
            self._keep_tail(s)
        for b in reversed(s.blocks):
            self._release(b)
        if s.copy is not None:              # admitted, never run: the source's hold goes too
            self._release(s.copy[0])

    def _keep_tail(self, s: _Seq) -> None:
        """`partial`: a freed sequence's block holding its last prefilled rows (a prompt's tail, perhaps
        followed by decoded rows), when they do not fill it, is cached for those rows (under a key of its own, never a full block's), so that the same prompt
        again, or a conversation's next turn, copies them rather than computing them (`_take_rows`)."""
        bs, prefilled = self.block_size, len(s.tokens) if s.exact is None else min(s.exact, len(s.tokens))
        i = prefilled // bs                 # the first block not prefilled to its end
        rows = prefilled - i * bs
        if rows < 1 or i >= len(s.blocks) or self.ref[s.blocks[i]] != 1 or s.blocks[i] in self._key_of:
            return
        parent = s.hashes[i - 1] if i else s.root
        toks = s.tokens[i * bs:i * bs + rows]
        key = PART + block_hash(parent, toks)
        if key not in self._cache:
            self._register(s.blocks[i], key, parent, toks)

    def _register(self, b: int, key: bytes, parent: bytes, tokens) -> None:
        """Caches block b under key, a child of `parent` holding `tokens` (a full block's, or a tail's rows)."""
        self._cache[key] = b
        self._key_of[b] = key
        self._parent_of[b] = parent
        self._children.setdefault(parent, {})[b] = tuple(tokens)

    def preempt_newest(self, keep=()) -> object:
        """Frees the most recently admitted sequence not in `keep` and returns its id (the scheduler
        requeues it for recomputation); None when there is none."""
        for seq_id in self.sequences_newest_first():
            if seq_id not in keep:
                self.free(seq_id)
                self.stats["preemptions"] += 1
                return seq_id
        return None

    def reserve_or_preempt(self, seq_id, n_tokens: int) -> list:
        """reserve(), preempting the newest sequences until it fits: the one preemption rule (an
        older sequence never makes way for a newer one, so when seq_id is itself the newest it
        goes first). Returns the preempted ids in order; when seq_id is among them it is the last
        and holds no blocks any more."""
        out = []
        while True:
            try:
                self.reserve(seq_id, n_tokens)
                return out
            except PoolExhaustedError:
                victim = self.preempt_newest()
                if victim is None:             # seq_id is not in the pool: nothing to make room for
                    raise
                out.append(victim)
                if victim == seq_id:
                    return out

    # ------------------------------------------------------------------ blocks
    def drop_cached(self) -> None:
        """Forget every cached block no sequence holds (they become free): a prompt after this
        reuses nothing but the blocks of sequences still running."""
        for b in self._idle:
            self._uncache(b)
            self._free.append(b)
        self._idle.clear()

    def _take(self, b: int) -> None:
        if self.ref[b] == 0:
            self._idle.pop(b, None)
        self.ref[b] += 1

    def _allocate(self) -> int:
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._idle.popitem(last=False)        # least recently used cached block
            self._uncache(b)
            self.stats["evictions"] += 1
        self.ref[b] = 1
        return b

    def _uncache(self, b: int) -> None:
        del self._cache[self._key_of.pop(b)]
        parent = self._parent_of.pop(b)
        kids = self._children[parent]
        del kids[b]
        if not kids:
            del self._children[parent]

    def _release(self, b: int) -> None:
        if self.ref[b] <= 0:
            raise AssertionError(f"block {b} released with reference count {self.ref[b]}")
        self.ref[b] -= 1
        if self.ref[b] == 0:
            if b in self._key_of:
                self._idle[b] = None
                self._idle.move_to_end(b)
            else:
                self._free.append(b)

    def check(self) -> None:
        """Asserts the pool's invariants (tests): counts match the tables, every block in one state."""
        counts = [0] * self.n_blocks
        for s in self._seqs.values():
            for b in s.blocks + ([s.copy[0]] if s.copy else []):
                counts[b] += 1
            if self._blocks_for(len(s.tokens)) > len(s.blocks):
                raise AssertionError("a sequence holds more tokens than its blocks")
        for b in range(self.n_blocks):
            if counts[b] != self.ref[b] or self.ref[b] < 0:
                raise AssertionError(f"block {b}: ref {self.ref[b]}, held by {counts[b]} tables")
            states = (b in self._free) + (b in self._idle) + (self.ref[b] > 0)
            if states != 1:
                raise AssertionError(f"block {b} is in {states} states")
            if self.ref[b] > 1 and b not in self._key_of:
                raise AssertionError(f"uncached block {b} is shared by {self.ref[b]} tables")
            if b in self._idle and b not in self._key_of:
                raise AssertionError(f"idle block {b} has no key")
        for key, b in self._cache.items():
            if self._key_of.get(b) != key:
                raise AssertionError(f"cache entry of block {b} is inconsistent")
        if sorted(b for kids in self._children.values() for b in kids) != sorted(self._key_of):
            raise AssertionError("the cached blocks by parent key differ from the cache")
