// matmul_gemm: y[t, n0 + r] (+)= sum_k x[t, k] * W[r, k] (+ bias[n0 + r]) for any T (prefill,
// embedders), f32 accumulation; for GPUs.
// dispatch (ceil(rows / BT), ceil(T / BT), 1) per weight buffer, workgroup WG = (BT / 4)^2.
//
// The host prepends the activation header, consts BT (output tile edge: 32 or 64), NTH = BT / 4,
// WG, RR = 1, `xword` / `xget`, `wmap4`, and matmul.wgsl (MatmulParams, bindings 0, 1, 3, 4, WChunk,
// store); the weight type's file follows (binding 2, `wchunk` / `wvec4`, the decode every kernel
// uses).
//
// Strategy: a workgroup owns a BT x BT tile of y (BT activation rows x BT weight rows). Per K step
// of 32 columns it stages the x tile and the dequantised weight tile in workgroup memory, both
// k-major, so that the NTH x NTH invocations, each holding a 4 x 4 register block (rows ty + NTH i,
// columns tx + NTH j), read consecutive words (weights) or one broadcast word (x). Every output is
// summed in the same order, k = 0, 1, ..., K - 1, one fma at a time, whatever T and wherever the
// row falls in its tile: a row's result does not depend on T (row-invariant prefill).

var<workgroup> xs: array<f32, 32 * BT>;   // (32, BT): x[t_base + t, k0 + k] at k * BT + t
var<workgroup> ws: array<f32, 32 * BT>;   // (32, BT): W[n_base + n, k0 + k] at k * BT + n

// 32 weights of chunk c of the row at word b as plain values (float rows' K % 32 tail: zeros past K)
fn gemm_weights(b: u32, c: u32) -> array<vec4<f32>, 8> {
    var v: array<vec4<f32>, 8>;
    if (c < P.nchunks) {
        let wc = wchunk(b, c);
        for (var i = 0u; i < 4u; i++) {
            v[i] = wc.q[i] * wc.s.x + wc.s.z;
            v[i + 4u] = wc.q[i + 4u] * wc.s.y + wc.s.w;
        }
    } else {
        for (var i = 0u; i < 8u; i++) {
            let q = c * 8u + i;
            v[i] = select(vec4<f32>(0.0), wvec4(b, min(q, P.k4 - 1u)), q < P.k4);
        }
    }
    return v;
}

@compute @workgroup_size(WG)
fn matmul_gemm(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let tx = lid % NTH;
    let ty = lid / NTH;
    let n_base = wid.x * BT;
    let t_base = wid.y * BT;
    let k4 = P.K / 4u;
    let lt = P.T - 1u;
    var a0 = vec4<f32>(0.0);   // a_i[j]: activation row t_base + ty + NTH i, weight row n_base + tx + NTH j
    var a1 = vec4<f32>(0.0);
    var a2 = vec4<f32>(0.0);
    var a3 = vec4<f32>(0.0);
    let steps = (k4 + 7u) / 8u;
    for (var c = 0u; c < steps; c++) {
        // x tile: BT rows x 8 act4 words; rows past T re-read row T - 1, columns past K are zeros
        for (var e = lid; e < 8u * BT; e += WG) {
            let tr = e / 8u;
            let q = e % 8u;
            let kq = c * 8u + q;
            var v = vec4<f32>(0.0);
            if (kq < k4) { v = xget(P.x_off4 + min(t_base + tr, lt) * k4 + kq); }
            xs[(4u * q) * BT + tr] = v.x;
            xs[(4u * q + 1u) * BT + tr] = v.y;
            xs[(4u * q + 2u) * BT + tr] = v.z;
            xs[(4u * q + 3u) * BT + tr] = v.w;
        }
        // weight tile: invocation n < BT decodes chunk c of weight row n_base + n
        if (lid < BT) {
            let v = gemm_weights(min(n_base + lid, P.rows - 1u) * P.row_words, c);
            for (var i = 0u; i < 8u; i++) {
                ws[(4u * i) * BT + lid] = v[i].x;
                ws[(4u * i + 1u) * BT + lid] = v[i].y;
                ws[(4u * i + 2u) * BT + lid] = v[i].z;
                ws[(4u * i + 3u) * BT + lid] = v[i].w;
            }
        }
        workgroupBarrier();
        for (var k = 0u; k < 32u; k++) {
            let xo = k * BT + ty;
            let wo = k * BT + tx;
            let wv = vec4<f32>(ws[wo], ws[wo + NTH], ws[wo + 2u * NTH], ws[wo + 3u * NTH]);
            a0 = fma(vec4<f32>(xs[xo]), wv, a0);
            a1 = fma(vec4<f32>(xs[xo + NTH]), wv, a1);
            a2 = fma(vec4<f32>(xs[xo + 2u * NTH]), wv, a2);
            a3 = fma(vec4<f32>(xs[xo + 3u * NTH]), wv, a3);
        }
        workgroupBarrier();
    }
    for (var j = 0u; j < 4u; j++) {
        let n = n_base + tx + NTH * j;
        store(t_base + ty, n, a0[j]);
        store(t_base + ty + NTH, n, a1[j]);
        store(t_base + ty + 2u * NTH, n, a2[j]);
        store(t_base + ty + 3u * NTH, n, a3[j]);
    }
}
