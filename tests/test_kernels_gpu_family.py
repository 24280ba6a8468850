"""The GPU kernel family (kernels/matmul/gpu.py: coalesced decode, tiled GEMM) on the real adapter
against float64 numpy, the GEMM's row invariance, and the family switch of kernels/matmul/
(WEBGPU_ENGINE_KERNELS, the built-in default per adapter type, tuned profiles).

Error measure as in test_kernels_matmul.py: max |y - ref| / max |ref|; f32 1e-4, f16 1e-2.
"""
from __future__ import annotations

import numpy as np
import pytest

from webgpu_engine.kernels import matmul as mm
from webgpu_engine.kernels.matmul import gpu as mg
from webgpu_engine.kernels import profiles
from webgpu_engine.kernels import quant_ref as qr
from webgpu_engine.kernels.common import new_tensor, run_ops
from webgpu_engine.kernels.matmul import QTYPES, gpu_row_bytes

from _matmul_util import TOL, matmul_case, read_tensor, rel_err, upload_tensor

OWNER = "test:matmul_gpu"


@pytest.fixture(autouse=True)
def _free(device):
    yield
    device.release_owner(OWNER)


def _check(dev, qtype, n, k, T, act, variant, *, row_invariant=False, seed=0, **kw):
    rng = np.random.default_rng(seed + n + k + T)
    w, xt, yt, bt, ref = matmul_case(dev, qtype, n, k, T, act, rng, owner=OWNER, **kw)
    op = mg.matmul(dev, xt, w, yt, bias=bt, accumulate=kw.get("accumulate", False), variant=variant,
                   row_invariant=row_invariant)
    run_ops(dev, op)
    y = read_tensor(dev, yt)
    e = rel_err(y, ref)
    assert e < TOL[act], f"{qtype} {act} T={T} ({n}x{k}) {variant}: error {e:.3g}"
    return op, y


def _act(qtype: str) -> str:
    return "f16" if qtype in ("q4_0", "q6_k", "bf16", "q3_k") else "f32"


# --------------------------------------------------------------------------- against numpy
@pytest.mark.parametrize("qtype", QTYPES)
def test_decode_every_type(device, qtype):
    """The decode kernel with each type's decode: N = 37 (not a multiple of the rows per workgroup),
    T = 3 (a padded 4-row bucket)."""
    _check(device, qtype, 37, 256, 3, _act(qtype), mg.Decode(2, 16, 64))


@pytest.mark.parametrize("qtype", ["q4_1", "q8_0", "q4_k", "f16", "q5_0"])
def test_gemm_every_family_of_type(device, qtype):
    """The GEMM with a float row (f16) and dequant.wgsl decodes of each block shape (Q4_1, Q8_0,
    Q4_K, Q5_0): N = 70 and T = 65 (partial tiles both ways)."""
    _check(device, qtype, 70, 256, 65, _act(qtype), mg.Gemm(64), row_invariant=True)


@pytest.mark.parametrize("variant", mg.DECODE_VARIANTS + (mg.Decode(4, 8, 32), mg.Decode(1, 64, 128)),
                         ids=lambda v: v.key)
def test_decode_variants_and_rows(device, variant):
    """Every decode variant at T = 1, 2, 3 and 8; K = 288 (9 chunks: lanes with one chunk, lanes
    with none), N = 45 (a partial row group)."""
    for T in (1, 2, 3, 8):
        _check(device, "q4_1", 45, 288, T, "f32", variant)


@pytest.mark.parametrize("variant", mg.GEMM_VARIANTS, ids=lambda v: v.key)
def test_gemm_variants_odd_shapes(device, variant):
    """K not a multiple of the 32-column K step (float rows: K = 100, 36), T = 1, 2, 3, 8, 33."""
    for T in (1, 2, 3, 8, 33):
        _check(device, "f32", 29, 100, T, "f32", variant)
    _check(device, "f16", 67, 36, 5, "f16", variant)


@pytest.mark.parametrize("variant", [mg.Decode(4, 16, 64), mg.Gemm(32)], ids=lambda v: v.key)
def test_options(device, variant):
    """bias, accumulate into y, tensors at unaligned offsets, a weight split over buffers, f32 rows
    whose K is not a multiple of 32."""
    _check(device, "q4_1", 70, 256, 5, "f32", variant, bias=True, accumulate=True, pad=12)
    op, _ = _check(device, "q8_0", 150, 256, 7, "f16", variant, parts=2,
                   max_binding=37 * gpu_row_bytes("q8_0", 256))
    assert len(op.dispatches) == 5          # one per weight buffer
    _check(device, "f32", 34, 100, 6, "f32", variant, bias=True)


def test_interleaved_weight(device):
    """A weight stored in interleaved 4-row spans (the CPU family's upload layout) reads the same:
    a tuned profile can send such a weight to the GPU kernels."""
    rng = np.random.default_rng(6)
    raw = qr.random_weight("q4_1", 96, 256, rng)
    w = mm.upload_weight(device, raw, "q4_1", 96, 256, owner=OWNER, interleave=True)
    assert w.inter_full > 0
    x = rng.standard_normal((4, 256)).astype(np.float32)
    ref = x.astype(np.float64) @ qr.dequantize(raw, "q4_1", 96, 256).T
    xt = upload_tensor(device, x, "f32", owner=OWNER)
    for v in (mg.Decode(2, 16, 64), mg.Gemm(64)):
        yt = new_tensor(device, (4, 96), "f32", owner=OWNER)
        run_ops(device, mg.matmul(device, xt, w, yt, variant=v))
        assert rel_err(read_tensor(device, yt), ref) < TOL["f32"], v


# --------------------------------------------------------------------------- row invariance
@pytest.mark.parametrize("qtype,act", [("q4_1", "f32"), ("q8_0", "f16"), ("f32", "f32")])
def test_gemm_rows_do_not_depend_on_T(device, qtype, act):
    """Each row of the GEMM is bit for bit the same whatever T: all 70 rows at once, one row alone,
    and chunks of 3 and 64 rows (prefill chunking)."""
    k = 100 if qtype == "f32" else 256
    _, full = _check(device, qtype, 70, k, 70, act, mg.Gemm(64), row_invariant=True)
    rng = np.random.default_rng(70 + k + 70)
    w, xt, yt, _, _ = matmul_case(device, qtype, 70, k, 70, act, rng, owner=OWNER)
    for T in (1, 3, 64):
        for t0 in (0, 5):
            x = xt.view((T, k), t0 * k)
            y = yt.view((T, 70), t0 * 70)
            run_ops(device, mg.matmul(device, x, w, y, variant=mg.Gemm(64), row_invariant=True))
            np.testing.assert_array_equal(read_tensor(device, y), full[t0:t0 + T], err_msg=f"T={T} at {t0}")


def test_errors(device):
    rng = np.random.default_rng(1)
    w, xt, yt, _, _ = matmul_case(device, "q4_0", 64, 256, 9, "f32", rng, owner=OWNER)
    with pytest.raises(ValueError, match="1..8 rows"):
        mg.matmul(device, xt, w, yt, variant=mg.Decode())
    with pytest.raises(ValueError, match="row_invariant needs the GEMM"):
        mg.matmul(device, xt.view((2, 256)), w, yt.view((2, 64)), variant=mg.Decode(), row_invariant=True)
    with pytest.raises(ValueError, match="unsupported decode variant"):
        mg.matmul(device, xt.view((2, 256)), w, yt.view((2, 64)), variant=mg.Decode(3, 16, 64))
    with pytest.raises(ValueError, match="unknown variant"):
        mg.variant("decode-rx")
    assert mg.variant(mg.Decode(4, 16, 64).key) == mg.Decode(4, 16, 64)
    assert mg.variant("gemm-32") == mg.Gemm(32)


# --------------------------------------------------------------------------- the family switch
def _kernel_of(op) -> str:
    return op.name.split("[")[0]


def test_cpu_adapter_default_is_todays_strategy(device, monkeypatch):
    """Unset, a CPU adapter runs the CPU family: the strategy it had before the families existed,
    and no GPU-family kernel for any T."""
    monkeypatch.delenv(mm.FAMILY_ENV, raising=False)
    assert mm.is_cpu_adapter(device)
    assert mm.default_config(device) == mm.MatmulConfig(unroll=True, tiled=True, family="cpu")
    rng = np.random.default_rng(3)
    w, xt, yt, _, _ = matmul_case(device, "q4_1", 64, 256, 20, "f32", rng, owner=OWNER)
    for T, ri in ((1, False), (4, False), (20, False), (1, True), (20, True)):
        op = mm.matmul(device, xt.view((T, 256)), w, yt.view((T, 64)), row_invariant=ri)
        assert _kernel_of(op) != "matmul_gpu", (T, ri)


def test_forced_gpu_family(device, monkeypatch):
    """WEBGPU_ENGINE_KERNELS=gpu: plain matmuls run the GPU kernels (decode up to 8 rows, the GEMM
    beyond and for row-invariant calls), nothing is fused by default, forced fusions still work;
    unknown values are refused."""
    monkeypatch.setenv(mm.FAMILY_ENV, "gpu")
    cfg = mm.default_config(device)
    assert cfg.family == "gpu" and not cfg.unroll and not cfg.tiled
    rng = np.random.default_rng(4)
    w, xt, yt, _, ref = matmul_case(device, "q4_1", 64, 256, 20, "f32", rng, owner=OWNER)
    assert not mm.fusable(device, 1, w) and not mm.epilogue_ok(device, w.qtype, w.n, w.k)
    for T, ri, kind in ((1, False, mg.Decode), (8, False, mg.Decode), (9, False, mg.Gemm), (1, True, mg.Gemm),
                        (20, True, mg.Gemm)):
        assert isinstance(mm._family_variant(device, cfg, w, T, ri), kind), (T, ri)
        op = mm.matmul(device, xt.view((T, 256)), w, yt.view((T, 64)), row_invariant=ri)
        assert _kernel_of(op) == "matmul_gpu"
        run_ops(device, op)
        assert rel_err(read_tensor(device, yt.view((T, 64))), ref[:T]) < TOL["f32"]
    g = upload_norm(device, 256)
    op = mm.matmul(device, xt.view((1, 256)), w, yt.view((1, 64)), norm=(g, 1e-5))   # fused: CPU kernels
    assert _kernel_of(op) == "matmul"
    monkeypatch.setenv(mm.FAMILY_ENV, "fast")
    with pytest.raises(ValueError, match="WEBGPU_ENGINE_KERNELS"):
        mm.default_config(device)


def test_a_weights_row_invariant_and_decode_rows_kernels_are_pinned(device, monkeypatch):
    """Once chosen, a weight's row-invariant (prefill) and decode_rows kernels stay for its life:
    a family switch or a profile stored later (another model tuning at load) must not give two
    prefill chunk heights of a loaded model different kernels. A new weight sees the switch."""
    monkeypatch.setenv(mm.FAMILY_ENV, "cpu")
    rng = np.random.default_rng(6)
    w, xt, yt, _, ref = matmul_case(device, "q4_1", 64, 256, 20, "f32", rng, owner=OWNER)
    first = {T: _kernel_of(mm.matmul(device, xt.view((T, 256)), w, yt.view((T, 64)), row_invariant=True))
             for T in (1, 20)}
    rows = _kernel_of(mm.matmul(device, xt.view((3, 256)), w, yt.view((3, 64)), decode_rows=True))
    assert "matmul_gpu" not in first.values() and rows != "matmul_gpu"
    monkeypatch.setenv(mm.FAMILY_ENV, "gpu")
    for T in (1, 7, 20):
        op = mm.matmul(device, xt.view((T, 256)), w, yt.view((T, 64)), row_invariant=True)
        assert _kernel_of(op) == first[1 if T == 1 else 20], T
        run_ops(device, op)
        assert rel_err(read_tensor(device, yt.view((T, 64))), ref[:T]) < TOL["f32"]
    assert _kernel_of(mm.matmul(device, xt.view((3, 256)), w, yt.view((3, 64)), decode_rows=True)) == rows
    w2 = matmul_case(device, "q4_1", 64, 256, 20, "f32", rng, owner=OWNER)[0]
    assert _kernel_of(mm.matmul(device, xt.view((20, 256)), w2, yt.view((20, 64)), row_invariant=True)) == "matmul_gpu"
    assert _kernel_of(mm.matmul(device, xt.view((3, 256)), w2, yt.view((3, 64)), decode_rows=True)) == "matmul_gpu"


def upload_norm(dev, k):
    return upload_tensor(dev, np.ones(k, np.float32), "f32", owner=OWNER)


def test_tuned_profile(device, monkeypatch, tmp_path):
    """WEBGPU_ENGINE_KERNELS=tuned reads this adapter's profile from the cache: a stored variant
    runs for its shape and row class, "base" keeps the CPU family's kernels, and on a CPU adapter
    so do unmeasured shapes and a stored variant that cannot serve the rows."""
    monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(mm.FAMILY_ENV, "tuned")
    profiles.forget()
    try:
        rng = np.random.default_rng(5)
        w, xt, yt, _, ref = matmul_case(device, "q8_0", 64, 256, 8, "f32", rng, owner=OWNER)
        key = profiles.shape_key("q8_0", 64, 256, 1, False)
        path = profiles.save(device, {key: "decode-r4-l16-w64", profiles.shape_key("q8_0", 64, 256, 4, False): "base",
                                      profiles.shape_key("q8_0", 64, 256, 8, True): "decode-r1-l16-w64",
                                      profiles.shape_key("q8_0", 64, 256, 8, False): "warp-9"})
        assert path.parent.parent.name == "profiles" and path.is_file()
        profiles.forget()                     # read back from the file
        cfg = mm.default_config(device)
        assert cfg.family == "tuned" and cfg.unroll       # a CPU adapter's flags
        assert mm._family_variant(device, cfg, w, 1, False) == mg.Decode(4, 16, 64)
        assert mm._family_variant(device, cfg, w, 3, False) is None          # "base"
        assert mm._family_variant(device, cfg, w, 2, False) is None          # not measured
        assert mm._family_variant(device, cfg, w, 8, True) is None   # unfit: as not measured
        assert mm._family_variant(device, cfg, w, 8, False) is None  # unknown key: as not measured
        op = mm.matmul(device, xt.view((1, 256)), w, yt.view((1, 64)))
        assert _kernel_of(op) == "matmul_gpu"
        run_ops(device, op)
        assert rel_err(read_tensor(device, yt.view((1, 64))), ref[:1]) < TOL["f32"]
    finally:
        profiles.forget()


@pytest.mark.parametrize("family", ["cpu", "gpu"])
def test_decode_rows_do_not_depend_on_the_row_count(device, monkeypatch, family):
    """decode_rows (continuous batching's decode steps): each row bit for bit the same for T = 1 ..
    20 (the GPU family's decode kernel in groups of 8 rows; the CPU family's row-invariant kernels),
    and right against numpy."""
    monkeypatch.setenv(mm.FAMILY_ENV, family)
    rng = np.random.default_rng(11)
    for qtype, kw in (("q4_1", {}), ("q8_0", {"accumulate": True})):
        w, xt, yt, bt, ref = matmul_case(device, qtype, 70, 256, 20, "f32", rng, owner=OWNER, **kw)
        rows = {}
        for T in (1, 2, 7, 8, 9, 16, 20):
            y = upload_tensor(device, np.zeros((T, 70), np.float32) if not kw else
                              read_tensor(device, yt.view((T, 70))), "f32", owner=OWNER)
            op = mm.matmul(device, xt.view((T, 256)), w, y, bias=bt, decode_rows=True, **kw)
            assert (_kernel_of(op) == "matmul_gpu") == (family == "gpu")
            run_ops(device, op)
            rows[T] = read_tensor(device, y)
            if not kw:
                assert rel_err(rows[T], ref[:T]) < TOL["f32"]
        for T, y in rows.items():
            assert np.array_equal(y, rows[20][:T]), (qtype, T)


def test_software_adapters_keep_the_cpu_family(monkeypatch):
    """lavapipe natively and the browser's SwiftShader fallback adapter run the CPU family (lavapipe
    with its unrolled / tiled strategy, SwiftShader with the plain kernels); a GPU does not."""
    from types import SimpleNamespace

    from webgpu_engine.gpu.base import AdapterInfo
    monkeypatch.delenv(mm.FAMILY_ENV, raising=False)

    def dev(**kw):
        return SimpleNamespace(info=AdapterInfo(**{"vendor": "", "architecture": "", "description": "",
                                                   "backend": "", **kw}))
    lavapipe = dev(adapter_type="CPU", device="llvmpipe (LLVM 15.0.6, 256 bits)")
    swiftshader = dev(vendor="google", architecture="swiftshader", adapter_type="fallback", backend="browser")
    assert mm.default_config(lavapipe) == mm.MatmulConfig(unroll=True, tiled=True, family="cpu")
    assert mm.default_config(swiftshader) == mm.MatmulConfig(unroll=False, tiled=False, family="cpu")
    assert mm.is_software_adapter(swiftshader) and not mm.is_cpu_adapter(swiftshader)
    gpu = dev(vendor="nvidia", architecture="hopper", adapter_type="DiscreteGPU", device="NVIDIA H200")
    assert not mm.is_software_adapter(gpu)


# --------------------------------------------------------------------------- subgroup reduction
SG_TYPES = ["q4_0", "q4_1", "q8_0", "q4_k", "q6_k", "f16", "q5_k"]


def _sg_variant(dev, rr=2, wg=64):
    """The subgroup decode variant with the most lanes this adapter allows (ln <= its smallest subgroup)."""
    ln = min(32, dev.subgroup_min_size)
    return mg.Decode(rr, ln, wg, sg=True)


@pytest.mark.parametrize("act", ["f32", "f16"])
@pytest.mark.parametrize("qtype", SG_TYPES)
def test_subgroup_decode_against_numpy(device, qtype, act):
    """The decode kernel reducing its lanes with subgroup shuffles: several weight types (Q5_K among
    them), T = 1, 2, 5, 8, N = 37 (not a multiple of the rows per workgroup);
    the same bits as the workgroup-memory reduction of the same variant."""
    assert device.has_subgroups, "lavapipe and GPUs list the subgroups feature"
    v = _sg_variant(device)
    assert device.info.subgroup_min_size >= 4 and v.ln >= 4
    for T in (1, 2, 5, 8):
        op, y = _check(device, qtype, 37, 256, T, act, v, bias=True)
        assert "subgroupShuffleXor" in _source_of(device, op)
        _, y_wg = _check(device, qtype, 37, 256, T, act, mg.Decode(v.rr, v.ln, v.wg), bias=True)
        np.testing.assert_array_equal(y, y_wg, err_msg=f"T={T}")


def _source_of(dev, op) -> str:
    key = op.dispatches[0][0].key
    return key.header


def test_subgroup_decode_rows_do_not_depend_on_T(device):
    """Each row of the subgroup variant is bit for bit the same for T = 1..8 (what decode_rows
    relies on), for other row-group shapes too, also with accumulate."""
    rng = np.random.default_rng(12)
    for v in (_sg_variant(device, 4, 64), _sg_variant(device, 1, 32)):
        for qtype, acc in (("q4_1", False), ("q8_0", True)):
            w, xt, yt, bt, ref = matmul_case(device, qtype, 45, 288, 8, "f32", rng, owner=OWNER, accumulate=acc)
            y0 = read_tensor(device, yt)
            rows = {}
            for T in range(1, 9):
                y = upload_tensor(device, y0[:T], "f32", owner=OWNER)
                run_ops(device, mg.matmul(device, xt.view((T, 288)), w, y, bias=bt, accumulate=acc, variant=v))
                rows[T] = read_tensor(device, y)
            if not acc:
                assert rel_err(rows[8], ref) < TOL["f32"], v
            for T, y in rows.items():
                np.testing.assert_array_equal(y, rows[8][:T], err_msg=f"{v.key} {qtype} T={T}")


def test_decode_rows_with_a_tuned_subgroup_variant(device, monkeypatch, tmp_path):
    """decode_rows through a profile that picked the subgroup variant: rows bit for bit the same
    for T = 1 .. 20 (groups of 8 rows), and right against numpy."""
    monkeypatch.setenv("WEBGPU_ENGINE_CACHE", str(tmp_path))
    monkeypatch.setenv(mm.FAMILY_ENV, "tuned")
    profiles.forget()
    try:
        rng = np.random.default_rng(13)
        w, xt, yt, bt, ref = matmul_case(device, "q4_k", 70, 256, 20, "f32", rng, owner=OWNER)
        v = _sg_variant(device, 4)
        profiles.save(device, {profiles.shape_key("q4_k", 70, 256, 1, False): v.key})
        rows = {}
        for T in (1, 2, 7, 8, 9, 16, 20):
            y = new_tensor(device, (T, 70), "f32", owner=OWNER)
            op = mm.matmul(device, xt.view((T, 256)), w, y, bias=bt, decode_rows=True)
            assert _kernel_of(op) == "matmul_gpu" and "subgroupShuffleXor" in _source_of(device, op)
            run_ops(device, op)
            rows[T] = read_tensor(device, y)
            assert rel_err(rows[T], ref[:T]) < TOL["f32"], T
        for T, y in rows.items():
            np.testing.assert_array_equal(y, rows[20][:T], err_msg=f"T={T}")
    finally:
        profiles.forget()


def test_subgroup_variants_keys_and_refusals(device, monkeypatch):
    """Keys with -sg parse back; a variant with more lanes than the smallest subgroup is refused;
    without the feature the kernel raises FeatureSupportError; the built-in default never picks it."""
    from webgpu_engine.errors import FeatureSupportError
    for v in mg.SUBGROUP_DECODE_VARIANTS:
        assert v.key.endswith("-sg") and mg.variant(v.key) == v
    assert mg.variant("decode-r4-l8-w64-sg") == mg.Decode(4, 8, 64, sg=True)
    with pytest.raises(ValueError, match="unknown variant"):
        mg.variant("decode-r4-l8-w64-sx")
    rng = np.random.default_rng(14)
    w, xt, yt, _, _ = matmul_case(device, "q4_0", 64, 256, 2, "f32", rng, owner=OWNER)
    big = mg.Decode(2, 2 * device.subgroup_min_size, 64, sg=True)
    with pytest.raises(ValueError, match="smallest subgroup"):
        mg.matmul(device, xt, w, yt, variant=big)
    monkeypatch.setattr(type(device), "has_subgroups", property(lambda self: False))
    with pytest.raises(FeatureSupportError, match="subgroups"):
        mg.matmul(device, xt, w, yt, variant=_sg_variant(device))
    for k in (64, 256, 1536, 4096):
        ws = type("W", (), {"k": k})()
        for T in range(1, 9):
            assert not mg.default_variant(ws, T, False).sg


def test_tuner_offers_subgroup_variants_only_with_the_feature(device, monkeypatch):
    """The tuner's decode candidates: the subgroup variants whose lanes fit the adapter's smallest
    subgroup where the device has the feature, none without it; the GEMM's list has none."""
    from webgpu_engine.kernels import tune
    rng = np.random.default_rng(15)
    w = matmul_case(device, "q4_1", 64, 256, 1, "f32", rng, owner=OWNER)[0]
    decode, prefill = tune.Case(w, "t1", 1), tune.Case(w, "prefill", 64)
    got = tune.candidates(decode)
    sg = [v for v in got if v.sg]
    assert sg and all(v.ln <= device.subgroup_min_size for v in sg)
    assert {v for v in mg.SUBGROUP_DECODE_VARIANTS if v.ln <= device.subgroup_min_size} == set(sg)
    assert set(got) - set(sg) == set(mg.DECODE_VARIANTS)
    assert tune.candidates(prefill) == list(mg.GEMM_VARIANTS)
    monkeypatch.setattr(type(device), "subgroup_min_size", property(lambda self: 32))
    assert {v.ln for v in tune.candidates(decode) if v.sg} == {4, 8, 16, 32}
    monkeypatch.setattr(type(device), "has_subgroups", property(lambda self: False))
    assert tune.candidates(decode) == list(mg.DECODE_VARIANTS)


def test_enable_directives_go_first():
    """A pipeline header assembled from pieces: `enable` directives merged into its first line
    (the subgroup reduction enables subgroups after other declarations), an extension the backend
    takes implicitly (naga: subgroups) left out; the line count kept."""
    from webgpu_engine.gpu.base import directives_first
    h = "enable f16;\nalias act = f16;\nconst LN: u32 = 4u;\nenable subgroups;\nfn f() {}\n"
    assert directives_first(h) == "enable f16, subgroups;\nalias act = f16;\nconst LN: u32 = 4u;\n\nfn f() {}\n"
    out = directives_first(h, frozenset({"subgroups"}))
    assert out.startswith("enable f16; // subgroups: implicit\n") and out.count("\n") == h.count("\n")
    assert "enable subgroups" not in out
    assert directives_first("alias act = f32;\n") == "alias act = f32;\n"
