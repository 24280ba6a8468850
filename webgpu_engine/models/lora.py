"""LoRA adapters over a loaded decoder, chosen per row of a batch (punica / S-LoRA's bgmv).

An adapter adds to a projection y = x · Wᵀ its scaled low-rank product: y += s · B · (A · x), with
A (r, K), B (N, r) and s = lora_alpha / r (rsLoRA: lora_alpha / sqrt(r)). Adapters come from PEFT
folders (adapter_config.json + adapter_model.safetensors) and llama.cpp's GGUF LoRA files
(convert_lora_to_gguf.py: general.type "adapter", adapter.type "lora", adapter.lora.alpha, tensors
blk.N.attn_q.weight.lora_a / .lora_b; s = alpha / r, 1 without alpha), targets q/k/v/o/gate/up/down
and the fused qkv / gate_up of Phi-3 (split into their parts on registering: split_fused); the
files are read by lora_files.py.

On the GPU a LoraPool holds up to `slots` adapters of rank <= `max_rank`, per layer and per input
the forward shares (q|k|v read one h, gate|up another), as kernels/lora.py's A (slots, J, K) and
B (slots, N, J) with J = targets x max_rank: an adapter's A rows of each target stacked, its B (s
folded in) laid out as the fused projection's output rows (q|k|v, gate / up in pairs where the
model interleaves them, q / k rows permuted where the base's are), zeros where it has no target
(on a CPU adapter lora_delta's B: compact). A
forward built with `rows` (LoraRows: the pool, a (P,) u32 slot per row, kernels/lora.py NONE for a
base row, and the groups some adapter targets) adds each row's delta to those projections' outputs
(decoder.py; o's and down's into x before their matmul adds to it); on a CPU adapter a decode or
verify step's matmuls make the deltas themselves (kernels/lora.py Delta: no dispatch of their own;
pre(), residual()); a row without an adapter is not touched. Adapters are registered host-side and uploaded into a slot on first use; a full pool evicts
the least recently used adapter no sequence is using. A request's scale of an adapter (llama.cpp's
per-request `lora` scales, one adapter or several at once) is an entry of its own (adapter_key: the
adapters' A rows and B x scale columns side by side, their ranks adding up to at most the pool's),
so rows of different scales share a batch and the kernels stay as they are. Layers whose FFN is a mixture of experts, or
whose token mixer is not attention, take no delta there (such targets are refused at load).
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from dataclasses import dataclass, replace

from ..errors import InvalidRequestError
from ..kernels import lora as lk
from ..kernels import nn
from ..kernels.common import Tensor, new_tensor
from .lora_files import (FUSED, TARGETS, LoraAdapter, LoraAdapterError, bf16_values, load_adapter, load_gguf,
                         load_peft)

__all__ = ["FUSED", "TARGETS", "LoraAdapter", "LoraAdapterError", "load_adapter", "load_gguf", "load_peft",
           "LoraPool", "LoraRows", "adapter_key", "key_parts", "split_fused", "check_adapter"]

# the projections that read one input, in the order their A rows stack: (group, targets)
GROUPS = (("qkv", ("q", "k", "v")), ("o", ("o",)), ("gate_up", ("gate", "up")), ("down", ("down",)))
_GROUP_OF = {t: g for g, ts in GROUPS for t in ts}
# the architecture llama.cpp's converters write for a base of ours where it is not our name
# (MistralForCausalLM converts as "llama": q / k permuted as Llama's)
_GGUF_ARCH = {"mistral": "llama"}
DEFAULT_MAX_RANK = 16
DEFAULT_SLOTS = 4


def adapter_key(scales: dict) -> str:
    """The pool entry (and a sequence's `adapter`) of adapters {name: a request's scale} applied
    together: the name itself for one adapter at 1, so that `model` = name and a scale of 1 share a
    slot and their prefix blocks."""
    return "\0+".join(n if s == 1.0 else f"{n}\0x{float(s)!r}" for n, s in sorted(scales.items()))


def key_parts(key: str) -> dict:
    """adapter_key's {name: scale}."""
    parts = (p.partition("\0x") for p in key.split("\0+"))
    return {name: float(scale) if scale else 1.0 for name, _, scale in parts}




# ---------------------------------------------------------------------- the model's layout
def _shapes(cfg, i: int) -> dict:
    """target -> (K, N) of layer i's projections (y = x · Wᵀ: W (N, K))."""
    C, D, F = cfg.hidden_size, cfg.head_dim_of(i), cfg.ffn_of(i)
    return {"q": (C, cfg.n_heads * D), "k": (C, cfg.n_kv_heads * D), "v": (C, cfg.n_kv_heads * D),
            "o": (cfg.n_heads * D, C), "gate": (C, F), "up": (C, F), "down": (F, C)}


def _out_rows(m, i: int, target: str, n: int, permuted: bool = False):
    """Where target's n output rows (in llama.cpp's permuted q / k order where `permuted`) sit in its
    group's fused output (numpy index array)."""
    import numpy as np
    c, rows = m.cfg, np.arange(n)
    D = c.head_dim_of(i)
    if target in ("q", "k") and permuted != (not c.rope_neox):
        # llama.cpp's permutation (adjacent-pair rope) of the q / k rows: row j of the permuted order
        # is row perm[j] of the unpermuted; B's rows go to the base's order
        heads = c.n_heads if target == "q" else c.n_kv_heads
        perm = rows.reshape(heads, 2, D // 2).swapaxes(1, 2).reshape(-1)
        rows = perm if permuted else np.argsort(perm)
    if target == "k":
        return rows + c.n_heads * D
    if target == "v":
        return rows + (c.n_heads + c.n_kv_heads) * D
    if target in ("gate", "up") and m.layers[i].gate_pairs:     # g0 g1 u0 u1 g2 g3 u2 u3 ...
        return 4 * (rows // 2) + rows % 2 + (2 if target == "up" else 0)
    if target == "up" and c.ffn_gated:
        return rows + c.ffn_of(i)
    return rows


def _group_n(m, i: int, group: str) -> int:
    c = m.cfg
    D, F = c.head_dim_of(i), c.ffn_of(i)
    return {"qkv": (c.n_heads + 2 * c.n_kv_heads) * D, "o": c.hidden_size,
            "gate_up": 2 * F if c.ffn_gated else F, "down": c.hidden_size}[group]


def _layer_groups(m, i: int) -> tuple:
    """The groups layer i's projections can take deltas in: not a MoE FFN's, nor the projections of
    a token mixer other than attention (Qwen3.5's Gated DeltaNet)."""
    L = m.layers[i]
    return tuple(g for g, _ in GROUPS if not (g in ("gate_up", "down") and L.experts is not None)
                 and not (g in ("qkv", "o") and L.mixer is not None))


def split_fused(m, ad: LoraAdapter) -> LoraAdapter:
    """`ad` with its fused targets (FUSED; a GGUF `up` of 2 x ffn rows without a `gate` beside it,
    as llama.cpp writes Phi-3's gate_up) split into their parts: each part the same A and its rows
    of B (B · A · x over the fused output is the parts' deltas side by side). Sizes that do not add
    up are refused naming the tensor."""
    c, weights, names = m.cfg, {}, {}
    for (i, t0), (a, b) in ad.weights.items():
        t, tensor = t0, ad.names.get((i, t0), f"layers.{i}.{t0}_proj")
        if t == "up" and (i, "gate") not in ad.weights and c.ffn_gated and i < c.n_layers \
                and b.shape[0] == 2 * c.ffn_of(i):
            t = "gate_up"
        if t not in FUSED or i >= c.n_layers:
            weights[(i, t)], names[(i, t)] = (a, b), tensor
            continue
        parts = FUSED[t] if t != "gate_up" or c.ffn_gated else ("up",)
        sizes = [_shapes(c, i)[p][1] for p in parts]
        if b.shape[0] != sum(sizes):
            raise LoraAdapterError(f"LoRA adapter {ad.name!r}: tensor {tensor} has B {b.shape}; the base's fused "
                                   f"{'|'.join(parts)} output has {sum(sizes)} rows: it was trained for another "
                                   f"base.", param="lora_path")
        at = 0
        for p, n in zip(parts, sizes):
            if p != t0 and (i, p) in ad.weights:
                raise LoraAdapterError(f"LoRA adapter {ad.name!r}: tensor {tensor} and {ad.names.get((i, p))} "
                                       f"both change layer {i}'s {p} projection.", param="lora_path")
            weights[(i, p)], names[(i, p)] = (a, b[at:at + n]), tensor
            at += n
    return replace(ad, weights=weights, names=names)


def check_adapter(m, ad: LoraAdapter, max_rank: int) -> None:
    """Refuse (LoraAdapterError naming the tensor) an adapter that does not fit model `m`."""
    c = m.cfg
    if ad.arch and ad.arch not in (c.arch, _GGUF_ARCH.get(c.arch)):
        raise LoraAdapterError(f"LoRA adapter {ad.name!r} is for a {ad.arch} model; the base is {c.arch}: it was "
                               f"trained for another base.", param="lora_path")
    if ad.rank > max_rank:
        raise LoraAdapterError(f"LoRA adapter {ad.name!r} has rank {ad.rank}, more than the pool's "
                               f"max_lora_rank {max_rank}. Load with a larger max_lora_rank.", param="lora_path")
    for (i, t), (a, b) in ad.weights.items():
        tensor = ad.names.get((i, t), f"layers.{i}.{t}_proj")
        if i >= c.n_layers:
            raise LoraAdapterError(f"LoRA adapter {ad.name!r}: tensor {tensor} is past the base model's "
                                   f"{c.n_layers} layers: it was trained for another base.", param="lora_path")
        if _GROUP_OF[t] not in _layer_groups(m, i):
            raise LoraAdapterError(f"LoRA adapter {ad.name!r}: tensor {tensor} targets a mixture-of-experts "
                                   f"FFN or a token mixer other than attention, which adapters cannot change "
                                   f"here.", param="lora_path")
        if t == "gate" and not c.ffn_gated:
            raise LoraAdapterError(f"LoRA adapter {ad.name!r}: tensor {tensor}: the base has no gate "
                                   f"projection.", param="lora_path")
        K, N = _shapes(c, i)[t]
        if a.shape[1] != K or b.shape[0] != N:
            raise LoraAdapterError(
                f"LoRA adapter {ad.name!r}: tensor {tensor} has A {a.shape} and B {b.shape}; the base's "
                f"projection maps {K} -> {N} (A ({ad.rank}, {K}), B ({N}, {ad.rank})): it was trained for "
                f"another base.", param="lora_path")


# ---------------------------------------------------------------------- the GPU pool
@dataclass
class _Group:
    a: Tensor          # (slots, J, K)
    b: Tensor          # (slots, N, J); lora_delta's: compact (slots, N, R)
    targets: tuple
    k: int
    n: int
    j: int
    cols: Tensor | None = None     # lora_delta's (N / 2,) u32: the first column of row pair p's target
    cols_host: object = None       # (N,) numpy: the first column of row n's target


class LoraPool:
    """Up to `slots` adapters of rank <= max_rank on the GPU for model `m` (see the module's note)."""

    def __init__(self, m, *, slots: int = DEFAULT_SLOTS, max_rank: int = DEFAULT_MAX_RANK, owner: str):
        c, dev = m.cfg, m.dev
        self.m, self.dev, self.slots, self.max_rank, self.owner = m, dev, int(slots), int(max_rank), owner
        # a CPU adapter pays per dispatch: a projection's delta in one (lora_delta, a workgroup per
        # row, its widths multiples of 4); a GPU spreads the expand's columns over workgroups
        # (lora_shrink + lora_expand)
        from ..kernels.matmul import is_software_adapter
        self.fused = is_software_adapter(dev) and all(k % 4 == 0 and n % 4 == 0 for i in range(c.n_layers)
                                                      for k, n in _shapes(c, i).values())
        # lora_delta's A and B in 16 bits while every registered adapter's values (B scaled) are f16
        # values, or all bf16 values (PEFT files saved in 16 bits): half the loads (_fit_layout)
        self._half = all(k % 8 == 0 for i in range(c.n_layers) for k, _ in _shapes(c, i).values())
        self.wdtype = "f16" if self._half else "f32"
        self._exact: dict[str, frozenset] = {}             # name -> the 16-bit dtypes holding its values
        if self.slots < 1 or self.max_rank < 1:
            raise InvalidRequestError("max_loras and max_lora_rank must be at least 1.", param="max_loras")
        self.groups: list[dict] = []                       # per layer: group -> _Group
        self._allocs = 0
        self._alloc()
        J = max(g.j for per in self.groups for g in per.values())
        self.u = new_tensor(dev, (m.chunk, J), owner=owner, label="lora.u")           # x · Aᵀ per row
        # the norm of x where a fused matmul norms it itself (decoder.py _lora_delta)       (P, C)
        self.h = new_tensor(dev, (m.chunk, c.hidden_size), m.dtype, owner=owner, label="lora.h")
        # the deltas of a projection whose matmul adds them to its sums itself (LoraRows.pre)
        n = max([g.n for per in self.groups for name, g in per.items() if name in ("qkv", "gate_up")] or [4])
        self.d = new_tensor(dev, (m.chunk, n), m.dtype, owner=owner, label="lora.d")
        self.registered: dict[str, LoraAdapter] = {}
        self._resident: OrderedDict = OrderedDict()        # adapter_key -> slot, least recently used first
        self._users: dict[str, int] = {}                   # adapter_key -> sequences using it now
        self._freed: asyncio.Event | None = None           # set when an entry's last user leaves (slot_free)

    def _alloc(self) -> None:
        """Each layer's group tensors in the kernels' layout (`fused`: lora_delta's A and compact B
        with its cols, `wdtype`; else lora_shrink / lora_expand's, f32)."""
        import numpy as np
        m, c, dev, owner, S = self.m, self.m.cfg, self.dev, self.owner, self.slots
        # each target's columns of u: the rank, a multiple of lora_delta's values per load
        self._allocs += 1
        vw = 4 if self.layout[1] == "f32" else 8
        R = self.width = -(-self.max_rank // vw) * vw if self.fused else self.max_rank
        for g in (g for per in self.groups for g in per.values()):
            for t in (g.a, g.b, g.cols):
                if t is not None:
                    t.buf.release()
        self.groups = []
        for i in range(c.n_layers):
            shapes, per = _shapes(c, i), {}
            for g, targets in GROUPS:
                if g not in _layer_groups(m, i):
                    continue
                ts = targets if g != "gate_up" or c.ffn_gated else ("up",)
                J, K, N = len(ts) * R, shapes[ts[0]][0], _group_n(m, i, g)
                name = f"lora.{i}.{g}"
                if not self.fused:
                    per[g] = _Group(new_tensor(dev, (S, J, K), owner=owner, label=name + ".a"),
                                    new_tensor(dev, (S, N, J), owner=owner, label=name + ".b"), ts, K, N, J)
                    continue
                cols = np.zeros(N, np.uint32)
                for t_i, t in enumerate(ts):
                    cols[_out_rows(m, i, t, shapes[t][1])] = t_i * R
                ct = new_tensor(dev, (N // 2,), "u32", owner=owner, label=name + ".cols")
                dev.write(ct.buf, np.ascontiguousarray(cols[::2]))     # rows 2p and 2p + 1: one target's
                wd = self.layout[1]
                per[g] = _Group(new_tensor(dev, (S, J, K), wd, owner=owner, label=name + ".a"),
                                new_tensor(dev, (S, N, R), wd, owner=owner, label=name + ".b"), ts, K, N, J, ct, cols)
            self.groups.append(per)

    @property
    def layout(self) -> tuple:
        """(fused, the weights' dtype, which allocation): what the op lists reading the pool were
        built for (those of an earlier one read released tensors)."""
        return (self.fused, self.wdtype if self.fused else "f32", self._allocs)

    def use_fused(self, fused: bool) -> None:
        """The CPU adapter's one-dispatch form (lora_delta) or the GPU's pair (op lists are built
        again for the new `layout`)."""
        if fused != self.fused:
            self.fused = fused
            self._relayout()

    def _relayout(self) -> None:
        """The pool's tensors laid out again and the resident adapters uploaded again."""
        self._alloc()
        for key, slot in self._resident.items():
            self._upload(key_parts(key), slot)

    # ------------------------------------------------------------------ registry
    def register(self, ad: LoraAdapter) -> None:
        """Register `ad` (a new version replaces one of its name that no running request uses)."""
        ad = split_fused(self.m, ad)
        check_adapter(self.m, ad, self.max_rank)
        self._refuse_in_use(ad.name, "load the new version")
        self._evict_all(ad.name)                           # uploaded again on its next use
        self.registered[ad.name] = ad
        self._exact[ad.name] = _exact_halves(ad)
        self._fit_layout()

    def unregister(self, name: str) -> None:
        self._refuse_in_use(name, "unload it")
        self.registered.pop(name, None)
        self._exact.pop(name, None)
        self._evict_all(name)
        self._fit_layout()

    def _fit_layout(self) -> None:
        """A and B in f16 where every registered adapter's values are f16 values, else in bf16 where
        they all are bf16 values, else f32 (the tensors laid out again on a change; the op lists are
        built again for the new `layout`)."""
        held = frozenset(HALVES).intersection(*self._exact.values()) if self._half else frozenset()
        wdtype = next((d for d in HALVES if d in held), "f32")
        if wdtype != self.wdtype:
            self.wdtype = wdtype
            if self.fused:
                self._relayout()

    def _refuse_in_use(self, name: str, then: str) -> None:
        users = sum(n for key, n in self._users.items() if name in key_parts(key))
        if users:
            raise InvalidRequestError(f"LoRA adapter {name!r} is in use by {users} running "
                                      f"requests; {then} when they are done.", param="lora_name")

    # ------------------------------------------------------------------ slots
    def acquire(self, key: str) -> int:
        """The slot of registered adapters at their scales (adapter_key) for a sequence (uploaded
        first where it is not on the GPU, evicting the least recently used idle entry); pair with
        release()."""
        slot = self._resident.get(key)
        if slot is None:
            slot = self._free_slot(key)
            self._upload(key_parts(key), slot)
            self._resident[key] = slot
        self._resident.move_to_end(key)
        self._users[key] = self._users.get(key, 0) + 1
        return slot

    def release(self, key: str) -> None:
        self._users[key] -= 1
        if not self._users[key] and self._freed is not None:
            self._freed.set()                              # its slot may go to a request waiting for one
            self._freed = None

    def can_acquire(self, key: str) -> bool:
        """Whether acquire(key) finds a slot now: the entry resident, or room for it (_room)."""
        return key in self._resident or self._room() is not None

    async def slot_free(self, key: str) -> None:
        """Wait until acquire(key) finds a slot (vLLM queues a request whose adapter would be one past
        max_loras): every slot is held by adapters of running sequences, so one of them ends first.
        Waiters wake in the order they came; an adapter unloaded meanwhile is refused."""
        while not self.can_acquire(key):
            if self._freed is None:
                self._freed = asyncio.Event()
            await self._freed.wait()
        gone = [n for n in key_parts(key) if n not in self.registered]
        if gone:
            raise InvalidRequestError(f"LoRA adapter {gone[0]!r} was unloaded while the request waited for a "
                                      f"slot.", param="model")

    def _room(self) -> tuple[int, str | None] | None:
        """Where a new entry goes: (a free slot, None), or (the slot of the least recently used entry
        no running sequence uses, that entry, to evict); None while running sequences hold every slot."""
        used = set(self._resident.values())
        free = [s for s in range(self.slots) if s not in used]
        if free:
            return free[0], None
        victim = next((k for k in self._resident if not self._users.get(k)), None)    # least recently used first
        return None if victim is None else (self._resident[victim], victim)

    def _free_slot(self, name: str) -> int:
        room = self._room()
        if room is not None:
            if room[1] is not None:
                self._evict(room[1])
            return room[0]
        raise InvalidRequestError(f"All {self.slots} LoRA slots are in use by running requests; "
                                  f"{', '.join(key_parts(name))} waits for one (raise max_loras).", param="model")

    def _evict(self, key: str) -> int:
        return self._resident.pop(key)

    def _evict_all(self, name: str) -> None:
        """The entries holding adapter `name`, at every scale."""
        for key in [k for k in self._resident if name in key_parts(k)]:
            self._evict(key)

    def resident(self) -> list[str]:
        return list(self._resident)

    def targeted(self) -> tuple:
        """The groups (GROUPS' names, in order) that some registered adapter targets."""
        used = {_GROUP_OF[t] for ad in self.registered.values() for t in ad.targets}
        return tuple(g for g, _ in GROUPS if g in used)

    def check_together(self, names) -> None:
        """Refuse adapters whose ranks add up to more than an entry holds (a request's `lora`)."""
        ranks = {n: self.registered[n].rank for n in names}
        if sum(ranks.values()) > self.width:
            raise InvalidRequestError(f"LoRA adapters {ranks} (name: rank) applied together need rank "
                                      f"{sum(ranks.values())}, more than the pool's {self.width}; load with "
                                      f"a larger max_lora_rank or apply fewer at once.", param="lora")

    def _upload(self, scales: dict, slot: int) -> None:
        """Adapters {name: a request's scale} into `slot`: each one's A rows and B x its scale x the
        request's columns side by side in its targets' blocks (in a pool held in 16 bits rounded to
        its dtype where a request's scale makes values that dtype does not hold)."""
        import numpy as np
        R = self.width
        for i, per in enumerate(self.groups):
            for g in per.values():
                A, B = np.zeros((g.j, g.k), np.float32), np.zeros((g.n, g.j), np.float32)
                at = 0
                for name, scale in scales.items():
                    ad = self.registered[name]
                    for t_i, t in enumerate(g.targets):
                        ab = ad.weights.get((i, t))
                        if ab is None:
                            continue
                        a, b = ab
                        cols = slice(t_i * R + at, t_i * R + at + ad.rank)
                        A[cols] = a
                        rows = _out_rows(self.m, i, t, b.shape[0], ad.qk_permuted)
                        bs = b * np.float32(ad.scale)
                        B[rows, cols] = bs if scale == 1.0 else bs * np.float32(scale)
                    at += ad.rank
                if g.cols is not None:                     # lora_delta's B
                    B = lk.compact_b(B[None], g.cols_host, R)[0]
                if g.a.dtype in HALVES:
                    A, B = HALVES[g.a.dtype][0](A), HALVES[g.a.dtype][0](B)
                self.dev.write(g.a.buf, A, slot * A.nbytes)
                self.dev.write(g.b.buf, B, slot * B.nbytes)

    def release_all(self) -> None:
        self.dev.release_owner(self.owner)


def _bf16(v):
    """f32 values as bf16 (uint16, rounded to nearest even: exact for bf16 values)."""
    import numpy as np
    bits = np.ascontiguousarray(v, np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def _f16(v):
    import numpy as np
    return np.asarray(v, np.float32).astype(np.float16)


def _from_f16(h):
    import numpy as np
    return h.astype(np.float32)


# the 16-bit dtypes a pool may hold A and B in, preferred first: (f32 values as it, and back)
HALVES = {"f16": (_f16, _from_f16), "bf16": (_bf16, bf16_values)}


def _exact_halves(ad: LoraAdapter) -> frozenset:
    """The 16-bit dtypes (HALVES) that hold every value of `ad`'s A and scaled B (as the pool holds
    them) exactly."""
    import numpy as np
    s = np.float32(ad.scale)
    vals = [np.ascontiguousarray(v, np.float32) for a, b in ad.weights.values() for v in (a, b * s)]
    return frozenset(d for d, (to, back) in HALVES.items() if all(np.array_equal(back(to(v)), v) for v in vals))


@dataclass(frozen=True)
class LoraRows:
    """What a forward with adapters reads: the pool, each row's slot (kernels/lora.py NONE: the
    base) and the projection groups whose deltas it adds (None: all; the others are left as the
    base computes them, fusions included); `rows`: the rows of one sequence (a prefill chunk's, one
    adapter) a CPU adapter's lora_delta workgroup takes at once (kernels/lora.py lora_rows)."""

    pool: LoraPool
    idx: Tensor             # (P,) u32
    groups: tuple | None = None
    rows: int = 1

    def delta(self, i: int, group: str, x: Tensor, y: Tensor, T: int, norm: tuple | None = None,
              store: bool = False) -> list:
        """y[t] += each row's adapter's B · A · x[t] for layer i's `group` (x (T, K), y (T, N)); with
        `norm` (w, eps) of x * w / rms(x) instead; `store` (y from pre()): y[t] = the delta."""
        p, g = self.pool, self._group(i, group)
        if g is None:
            return []
        dev, idx, x = p.dev, self.idx.view((T,)), x.view((T, g.k))
        if p.fused:
            return [lk.lora_delta(dev, x, g.a, g.b, g.cols, idx, y.view((T, g.n)), slots=p.slots, norm=norm,
                                  store=store, rows=self.rows if T > 1 else 1)]
        ops = []
        if norm is not None:
            ops.append(nn.rms_norm(dev, x, norm[0], p.h.view((T, g.k)), eps=norm[1]))
            x = p.h.view((T, g.k))
        u = p.u.view((T, g.j))
        return ops + [lk.lora_shrink(dev, x, g.a, idx, u, slots=p.slots),
                      lk.lora_expand(dev, u, g.b, idx, y.view((T, g.n)), slots=p.slots)]

    def pre(self, i: int, group: str, T: int, inside: bool = False) -> "Tensor | lk.Delta | None":
        """Where layer i's `group` deltas go when its matmul adds them to its sums before a fused
        epilogue (the RoPE + KV write, act(gate) * up), on a CPU adapter: with `inside` (the matmul
        reads x as is or with a norm's partial sums) where the matmul can make them itself
        (inside_ok: a Delta, no dispatch of their own), else stored first by lora_delta, a base
        row's as -0.0. None where the group takes no delta."""
        g = self._group(i, group)
        if not self.pool.fused or g is None:
            return None
        if inside and self.inside_ok(T):
            return self._delta(g, T)
        return self.pool.d.view((T, g.n))

    def _group(self, i: int, group: str):
        """Layer i's `group` of the pool where this forward adds its deltas (an adapter targets it),
        else None."""
        g = self.pool.groups[i].get(group)
        return None if g is None or (self.groups is not None and group not in self.groups) else g

    def _delta(self, g, T: int, res: bool = False) -> "lk.Delta":
        """Group g's deltas for the matmul of its projection to make over T rows (kernels/lora.py)."""
        return lk.Delta(g.a, g.b, g.cols, self.idx.view((T,)), self.pool.slots, g.n, g.k, res=res)

    def inside_ok(self, T: int) -> bool:
        """Whether a decode matmul of T rows can make the rows' deltas itself (kernels/lora.py
        Delta): a CPU adapter's pool, one row a LoRA workgroup (a decode or verify step's rows), a
        device that binds the matmul's 4 more storage buffers."""
        p = self.pool
        return (p.fused and (T == 1 or self.rows == 1)
                and int(p.dev.limits.get("max-storage-buffers-per-shader-stage", 8)) >= 18)

    def residual(self, i: int, group: str, T: int) -> "lk.Delta | None":
        """Layer i's one-target `group` (o, down) deltas made by its residual matmul itself, into x
        before the next norm's values (a Delta with res), where the group is targeted and inside_ok;
        else None (the deltas go into x before the matmul: delta())."""
        g = self._group(i, group)
        return None if g is None or not self.inside_ok(T) else self._delta(g, T, res=True)

    def plan(self, plan):
        """`plan` without the fusions that hide a projection's output from its delta: act(gate) * up
        read by the down matmul (gate, up or down) and, unless its matmul adds the stored deltas
        itself (pre(): a CPU adapter), the RoPE + KV write of the qkv matmul (q, k or v targeted)
        and act(gate) * up stored by the gate_up matmul (gate or up). The others stay, so that a
        base row's values are those of the plan without adapters: a fused norm's input is normed
        apart for the delta, and o's and down's deltas go into x before their matmul adds to it
        (and stores the next norm)."""
        on = set(self.groups if self.groups is not None else (g for g, _ in GROUPS))
        out = replace(plan, gate_in_down=plan.gate_in_down and not on & {"gate_up", "down"})
        if self.pool.fused:
            return out
        if "qkv" in on:
            out = replace(out, rope_kv=(False,) * len(plan.rope_kv))
        if "gate_up" in on:
            out = replace(out, gate_out=(False,) * len(plan.gate_out))
        return out
