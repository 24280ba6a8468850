"""One sequence through the forward every request runs (models/paged.py PagedForward over a
models/kv_pool.py pool), without a scheduler or a sampler: a model built by hand (the golden tests,
benchmarks) prefills tokens, decodes one token a step and leaves each step's logits in `logits`.

    seq = PagedSequence.build(dev, cfg, weights, owner="...", context_window=512, prefill_chunk=128)
    seq.prefill(ids[:P], 0)          # PREFILL chunks of at most prefill_chunk rows; the last row's logits
    seq.decode(token, P)             # one ROWS row, as a batch of one sequence computes it
    dev.read_sync(seq.logits.buf, seq.logits.offset, seq.logits.nbytes)        # (V,) in the model's dtype

The plan is the one a load makes (models/plan.py plan_decoder) for max_num_sequences 1, so the pool,
its ring (a sliding window with sinks) and its KV dtype are what a user's load of those options gets.
A step at a position before the sequence's end writes it again: the rows from there on are forgotten
first (the pool's blocks are private, so a cut may fall anywhere); a model with recurrent states
(Qwen3.5) goes back only to position 0, where its states start over. Standard library only.
"""
from __future__ import annotations

from types import SimpleNamespace

from ..kernels.common import Ring, Tensor
from .kv_pool import KVPool
from .llama import LlamaModel
from .paged import PagedForward
from .plan import plan_decoder

SEQ = "one"          # the sequence's id in its pool, and its slot of the recurrent states: 0


class PagedSequence:
    """A loaded LlamaModel's PagedForward and pool, holding one sequence."""

    def __init__(self, model: LlamaModel):
        self.model, self.dev = model, model.dev
        plan = model.plan
        self.fwd = PagedForward(model, max_seqs=1, n_blocks=plan.kv_pool_blocks, block_size=plan.kv_block_size,
                                owner=model.owner)
        self.pool = KVPool(plan.kv_pool_blocks, plan.kv_block_size, share=False, ring_rows=self.fwd.ring_rows,
                           ring_sinks=model.ring.sinks if model.ring else 0)
        self.pool.add_sequence(SEQ, [])
        self.logits: Tensor = self.fwd.logits_row(0)          # (V,): the last step's
        self._state = 0 if self.fwd.recurrent else None

    @classmethod
    def build(cls, dev, cfg, weights: dict, *, owner: str, context_window: int = 4096, prefill_chunk: int = 256,
              dtype: str = "f32", kv_cache_dtype: str = "auto", ring: Ring | None = None, **model_kw) -> "PagedSequence":
        """The model of `weights` loaded as a load with these chat options plans it (a ring: context
        -1, its window and sinks), with a pool for one sequence; `model_kw`: LlamaModel's (max_total_bytes)."""
        opts = SimpleNamespace(dtype=dtype, context_window_size=-1 if ring else context_window,
                               prefill_chunk_size=prefill_chunk, max_num_sequences=1, kv_block_size=16,
                               kv_pool_tokens=0, kv_cache_dtype=kv_cache_dtype or "auto",
                               sliding_window_size=ring.window if ring else -1,
                               attention_sink_size=ring.sinks if ring else 0)
        return cls(LlamaModel(dev, cfg, weights, owner=owner, plan=plan_decoder(cfg, opts, dev), **model_kw))

    def _at(self, pos: int) -> None:
        """Make `pos` the sequence's next position: the rows from there on are forgotten."""
        n = self.pool.num_tokens(SEQ)
        if pos > n:
            raise ValueError(f"position {pos} skips positions {n}..{pos - 1}")
        if pos == n:
            return
        if pos and (self.fwd.recurrent or self.fwd.ring_rows and n > self.fwd.ring_rows):
            raise ValueError(f"position {pos} again: this sequence's states (or ring) hold later rows; "
                             f"start over at position 0")
        self.pool.truncate(SEQ, pos)

    def record_prefill(self, batch, tokens: list[int], pos0: int, with_head: bool = True) -> None:
        """Record the forward of tokens (1 .. prefill_chunk of them) at positions pos0 .. into batch."""
        self._at(pos0)
        end = pos0 + len(tokens)
        self.pool.reserve(SEQ, end)
        self.fwd.record_prefill(batch, tokens, pos0, self.pool.slots(SEQ, pos0, len(tokens)),
                                self.pool.block_table(SEQ), with_head, state_slot=self._state)
        self.pool.append_tokens(SEQ, tokens)

    def prefill(self, tokens: list[int], pos0: int = 0) -> None:
        """tokens at positions pos0 .. in chunks of at most prefill_chunk rows, each submitted; the last
        row's logits in `logits`."""
        P = self.model.chunk
        for s in range(0, len(tokens), P):
            b = self.dev.batch()
            self.record_prefill(b, tokens[s:s + P], pos0 + s, with_head=s + P >= len(tokens))
            self.dev.submit(b)

    def decode(self, token: int, pos: int) -> None:
        """One decode step feeding `token` at `pos`, submitted: its logits in `logits`."""
        self._at(pos)
        self.pool.reserve(SEQ, pos + 1)
        b = self.dev.batch()
        self.fwd.record_decode(b, [token], self.pool.decode_inputs([SEQ], 1, self.fwd.max_blocks),
                               states=None if self._state is None else [self._state])
        self.dev.submit(b)
        self.pool.append_tokens(SEQ, [token], decoded=True)

    def release(self) -> None:
        self.fwd.release()
        self.model.release()
