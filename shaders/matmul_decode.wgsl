// matmul_decode: the T = 1 (decode) matmul with the K loop unrolled into straight-line code, with
// optional fused inputs:
//   plain:  y[r] (+)= sum_k x[k] * W[r, k]                         (+ bias[r])
//   norm:   y[r] (+)= sum_k x[k] g[k] W[r, k] / sqrt(mean(x^2) + eps)   (RMSNorm fused in)
//   silu:   y[r] (+)= sum_k act(a[k]) a[F + k] W[r, k]              (a = [gate | up], act(gate)·up fused
//           in; act silu or gelu_tanh, gate_act.wgsl)
//   pnorm:  y[r] (+)= sum_k x[k] W[r, k] / sqrt(sum_i p[i] / K + eps)  (x = x0 * g and p = partial
//           sums of x0^2 from the matmul before: matmul_epilogue.wgsl ep_res_norm)
// Why unrolled: on CPU Vulkan (lavapipe) a storage load runs one SIMD lane at a time unless the
// driver can see the address is the same for every lane, which it only does for constant addresses
// outside any control flow. With the loop unrolled by the host and every x offset a constant, each x
// word is one scalar load broadcast to all lanes, so only the weight words cost per-lane loads.
// Several activation rows (continuous batching: one row per sequence's decode step): the host
// unrolls the rows too, row t's x (and pnorm partials) at its own constant offset; each weight chunk
// is decoded once (matmul.wgsl wchunks) for every row, and each row's sums are made exactly as the
// one-row kernel makes them (same calls, same order), so a row's result does not depend on how many
// rows run.
// Built after matmul.wgsl (WChunk, XChunk, xget, cdot, row_group, wchunks, rows4, store4, P; the
// x / y / bias bindings and store of matmul_io.wgsl) and before the
// weight's reader (codegen.weight_source). The host header adds the consts XOFF (x offset in xword units), NF (F / 4
// for silu), GOFF (g offset in vec4 units), EPS, and the generated entry point `matmul_decode`,
// which calls row_group, then per chunk c = 0 .. K/32 - 1 wchunks and per row dec_step(..., dec_x*(xo_t, c)),
// then dec_end per row.
// dispatch (ceil(rows / (WG * RR)), 1, 1), workgroup WG

@group(0) @binding(5) var<storage, read> g: array<vec4<f32>>;   // (K/4) RMSNorm weight (norm mode);
                                                                // (K/16) partial sums (pnorm mode)

struct DecAcc { a: vec4<f32>, ss: f32 }

fn xc_of(v: array<vec4<f32>, 8>) -> XChunk {
    let lo = (v[0] + v[1]) + (v[2] + v[3]);
    let hi = (v[4] + v[5]) + (v[6] + v[7]);
    return XChunk(v, vec2<f32>(dot(lo, vec4<f32>(1.0)), dot(hi, vec4<f32>(1.0))));
}

fn dec_x(xo: u32, c: u32) -> XChunk {
    return xchunk(xo + c * 8u);
}

fn dec_xn(xo: u32, c: u32) -> XChunk {   // x * g (the 1/rms factor is applied to the sums)
    let o = xo + c * 8u;
    let q = GOFF + c * 8u;
    var v: array<vec4<f32>, 8>;
    v[0] = xget(o) * g[q];
    v[1] = xget(o + 1u) * g[q + 1u];
    v[2] = xget(o + 2u) * g[q + 2u];
    v[3] = xget(o + 3u) * g[q + 3u];
    v[4] = xget(o + 4u) * g[q + 4u];
    v[5] = xget(o + 5u) * g[q + 5u];
    v[6] = xget(o + 6u) * g[q + 6u];
    v[7] = xget(o + 7u) * g[q + 7u];
    return xc_of(v);
}

fn dec_sq(xo: u32, c: u32) -> f32 {      // sum of x^2 over chunk c (norm mode)
    let o = xo + c * 8u;
    let v0 = xget(o);
    let v1 = xget(o + 1u);
    let v2 = xget(o + 2u);
    let v3 = xget(o + 3u);
    let v4 = xget(o + 4u);
    let v5 = xget(o + 5u);
    let v6 = xget(o + 6u);
    let v7 = xget(o + 7u);
    let s = (v0 * v0 + v1 * v1) + (v2 * v2 + v3 * v3) + (v4 * v4 + v5 * v5) + (v6 * v6 + v7 * v7);
    return dot(s, vec4<f32>(1.0));
}

fn dec_pss(go: u32, i: u32) -> f32 {     // 4 of the partial sums (pnorm mode)
    return dot(g[go + i], vec4<f32>(1.0));
}

fn silu4(a: vec4<f32>, u: vec4<f32>) -> vec4<f32> {   // act(gate) * up: gate4 from gate_act.wgsl
    return gate4(a) * u;
}

fn dec_xs(xo: u32, c: u32) -> XChunk {   // act(gate) * up
    let o = xo + c * 8u;
    var v: array<vec4<f32>, 8>;
    v[0] = silu4(xget(o), xget(o + NF));
    v[1] = silu4(xget(o + 1u), xget(o + NF + 1u));
    v[2] = silu4(xget(o + 2u), xget(o + NF + 2u));
    v[3] = silu4(xget(o + 3u), xget(o + NF + 3u));
    v[4] = silu4(xget(o + 4u), xget(o + NF + 4u));
    v[5] = silu4(xget(o + 5u), xget(o + NF + 5u));
    v[6] = silu4(xget(o + 6u), xget(o + NF + 6u));
    v[7] = silu4(xget(o + 7u), xget(o + NF + 7u));
    return xc_of(v);
}

fn dec_step(acc: DecAcc, d: WChunks, xc: XChunk) -> DecAcc {
    return DecAcc(rows4(d, xc, acc.a), acc.ss);
}

fn dec_end(t: u32, rows: RowGroup, acc: DecAcc, scale: f32) {
    store4(t, rows.r0, acc.a * scale);
}
