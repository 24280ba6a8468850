// lora_rows: lora_delta (lora.wgsl, which this file is prepended to with the subgroups feature) of
// 4 rows a workgroup: a prefill chunk's rows, one sequence's, so one adapter. A and B are read once
// for the 4 rows instead of once a row, and x reaches the shrink's lanes through the subgroup (a
// CPU driver loads workgroup memory lane by lane, so lane i of each 8 loads only vec4 i of a row's
// 32 staged values and subgroupBroadcast hands the 8 to every lane: matmul_wide.wgsl's way). Each
// row's sums are lora_delta's, in its order (x staged KCR values a row at a time, KCR / 4 a
// multiple of WG, so that a lane's share of x and its sum of squares are lora_delta's): a row gets
// lora_delta's bits. A group whose rows' slots differ goes a row at a time (delta_row); rows past T
// are not written. dispatch (ceil(T / 4), 1, 1); needs subgroups of 8 lanes or more.
const TR: u32 = 4u;
const KCR: u32 = 512u;
const MIXED: u32 = 0xFFFFFFFEu;
const UJ: u32 = (JMAX + 3u) / 4u;        // a row's u in wur, in vec4
var<workgroup> wxr: array<vec4<f32>, TR * KCR / 4u>;
var<workgroup> wur: array<vec4<f32>, TR * UJ>;
var<workgroup> wsame: u32;

@compute @workgroup_size(WG)
fn lora_rows(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32,
             @builtin(subgroup_invocation_id) sid: u32) {
    let t0 = wid.x * TR;
    let nr = min(TR, D.T - t0);
    if (lid == 0u) {
        var s = idx[t0];
        for (var r = 1u; r < nr; r++) {
            if (idx[t0 + r] != s) { s = MIXED; }
        }
        wsame = s;
    }
    let s = workgroupUniformLoad(&wsame);
    if (s == MIXED) {
        for (var r = 0u; r < nr; r++) {
            let sr = row_slot(t0 + r, lid);
            if (sr == NONE || sr >= D.slots) {
                store_none(t0 + r, lid);
            } else {
                delta_row(t0 + r, sr, lid);
            }
            workgroupBarrier();
        }
        return;
    }
    if (s == NONE || s >= D.slots) {
        for (var r = 0u; r < nr; r++) { store_none(t0 + r, lid); }
        return;
    }
    rows_delta(t0, nr, s, lid, sid % 8u);
}

// delta_row's work for rows t0 .. t0 + nr - 1 (TR = 4) of one adapter slot s, each weight load used
// for the 4 rows (rows past nr staged as zeros and not stored); a row's values in the components
// of vec4s, so that no loop indexes by row (on lavapipe, rows in arrays indexed in loops took 82.8
// ms for a 16-row chunk's LoRA ops, this form 59.5, before x went through the subgroup)
fn rows_delta(t0: u32, nr: u32, s: u32, lid: u32, ln: u32) {
    let K = select(D.K, SHAPE_K, SHAPE_K > 0u);
    let N = select(D.N, SHAPE_N, SHAPE_K > 0u);
    let J = select(D.J, SHAPE_J, SHAPE_K > 0u);
    let R = select(D.R, SHAPE_R, SHAPE_K > 0u);
    let K4 = K / VW;
    let a0 = (s * J) * K4;
    let NT = J / R;
    let KQ = KCR / 4u;
    let H = VW / 4u - 1u;                // VW = 8: a load's second 4 x values
    var inv = vec4<f32>(1.0);
    for (var l0 = 0u; l0 < R; l0 += WG) {
        let l = l0 + lid;
        let aj = a0 + min(l, R - 1u) * K4;   // lanes past R: row R - 1's sums again, not stored
        var acc = Acc3(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));   // rows t0 .. t0 + 3 of u's rows l, R + l, 2R + l
        var ss = vec4<f32>(0.0);
        for (var kc = 0u; kc < K; kc += KCR) {
            let kn = min(KCR, K - kc);
            workgroupBarrier();
            for (var k4 = lid; k4 < kn / 4u; k4 += WG) {
                let at = kc / 4u + k4;
                let x0 = (D.x_off + t0 * K) / 4u + at;
                var v0 = vec4<f32>(xv[x0]);
                var v1 = vec4<f32>(0.0);
                var v2 = vec4<f32>(0.0);
                var v3 = vec4<f32>(0.0);
                if (nr > 1u) { v1 = vec4<f32>(xv[x0 + K / 4u]); }
                if (nr > 2u) { v2 = vec4<f32>(xv[x0 + K / 2u]); }
                if (nr > 3u) { v3 = vec4<f32>(xv[x0 + 3u * K / 4u]); }
                if (NORM) {
                    ss = vec4<f32>(dot_seq(ss.x, v0, v0), dot_seq(ss.y, v1, v1), dot_seq(ss.z, v2, v2), dot_seq(ss.w, v3, v3));
                    let g = w4[at];
                    v0 *= g;
                    v1 *= g;
                    v2 *= g;
                    v3 *= g;
                }
                wxr[k4] = v0;
                wxr[KQ + k4] = v1;
                wxr[2u * KQ + k4] = v2;
                wxr[3u * KQ + k4] = v3;
            }
            workgroupBarrier();
            // 32 x values a block: lane ln's vec4 of each row broadcast to the lanes; the rest of
            // the chunk (kn not a multiple of 32) read from workgroup memory by every lane
            let ak = aj + kc / VW;
            let RK = R * K4;
            let nb = kn / 32u;
            for (var kb = 0u; kb < nb; kb++) {
                let o = kb * 8u + ln;
                let m0 = lanes8(wxr[o]);
                let m1 = lanes8(wxr[KQ + o]);
                let m2 = lanes8(wxr[2u * KQ + o]);
                let m3 = lanes8(wxr[3u * KQ + o]);
                let a = ak + kb * (32u / VW);
                if (VW == 8u) {
                    acc = rows_mac(acc, m0[0], m0[1], m1[0], m1[1], m2[0], m2[1], m3[0], m3[1], a, RK, NT);
                    acc = rows_mac(acc, m0[2], m0[3], m1[2], m1[3], m2[2], m2[3], m3[2], m3[3], a + 1u, RK, NT);
                    acc = rows_mac(acc, m0[4], m0[5], m1[4], m1[5], m2[4], m2[5], m3[4], m3[5], a + 2u, RK, NT);
                    acc = rows_mac(acc, m0[6], m0[7], m1[6], m1[7], m2[6], m2[7], m3[6], m3[7], a + 3u, RK, NT);
                } else {
                    acc = rows_mac(acc, m0[0], m0[0], m1[0], m1[0], m2[0], m2[0], m3[0], m3[0], a, RK, NT);
                    acc = rows_mac(acc, m0[1], m0[1], m1[1], m1[1], m2[1], m2[1], m3[1], m3[1], a + 1u, RK, NT);
                    acc = rows_mac(acc, m0[2], m0[2], m1[2], m1[2], m2[2], m2[2], m3[2], m3[2], a + 2u, RK, NT);
                    acc = rows_mac(acc, m0[3], m0[3], m1[3], m1[3], m2[3], m2[3], m3[3], m3[3], a + 3u, RK, NT);
                    acc = rows_mac(acc, m0[4], m0[4], m1[4], m1[4], m2[4], m2[4], m3[4], m3[4], a + 4u, RK, NT);
                    acc = rows_mac(acc, m0[5], m0[5], m1[5], m1[5], m2[5], m2[5], m3[5], m3[5], a + 5u, RK, NT);
                    acc = rows_mac(acc, m0[6], m0[6], m1[6], m1[6], m2[6], m2[6], m3[6], m3[6], a + 6u, RK, NT);
                    acc = rows_mac(acc, m0[7], m0[7], m1[7], m1[7], m2[7], m2[7], m3[7], m3[7], a + 7u, RK, NT);
                }
            }
            for (var k4 = nb * (32u / VW); k4 < kn / VW; k4++) {
                let i = k4 * (VW / 4u);
                acc = rows_mac(acc, wxr[i], wxr[i + H], wxr[KQ + i], wxr[KQ + i + H], wxr[2u * KQ + i],
                               wxr[2u * KQ + i + H], wxr[3u * KQ + i], wxr[3u * KQ + i + H], ak + k4, RK, NT);
            }
        }
        if (NORM && l0 == 0u) {
            inv = vec4<f32>(row_inv(lid, ss.x, K), row_inv(lid, ss.y, K), row_inv(lid, ss.z, K), row_inv(lid, ss.w, K));
        }
        if (l < R) {
            if (NORM) {
                acc.x *= inv;
                acc.y *= inv;
                acc.z *= inv;
            }
            put_ur(l, acc.x);
            if (NT > 1u) { put_ur(R + l, acc.y); }
            if (NT > 2u) { put_ur(2u * R + l, acc.z); }
        }
    }
    workgroupBarrier();
    // y += B · u as delta_row makes it, each B load for the 4 rows
    let R4 = R / VW;
    let b0 = s * N * R4;
    for (var q = lid; q < N / 4u; q += WG) {
        let c = cols[q] / 4u;
        let bn = b0 + 4u * q * R4;
        var y0 = vec4<f32>(0.0);         // row t0 + r's 4 values
        var y1 = vec4<f32>(0.0);
        var y2 = vec4<f32>(0.0);
        var y3 = vec4<f32>(0.0);
        for (var r4 = 0u; r4 < R4; r4++) {
            let w0 = wunpack(b4[bn + r4]);
            let w1 = wunpack(b4[bn + R4 + r4]);
            let w2 = wunpack(b4[bn + 2u * R4 + r4]);
            let w3 = wunpack(b4[bn + 3u * R4 + r4]);
            let ua = c.x + r4 * (VW / 4u);
            let ub = c.y + r4 * (VW / 4u);
            y0 = rows_expand(y0, 0u, ua, ub, w0, w1, w2, w3);
            y1 = rows_expand(y1, UJ, ua, ub, w0, w1, w2, w3);
            y2 = rows_expand(y2, 2u * UJ, ua, ub, w0, w1, w2, w3);
            y3 = rows_expand(y3, 3u * UJ, ua, ub, w0, w1, w2, w3);
        }
        rows_store(t0, N, q, y0);
        if (nr > 1u) { rows_store(t0 + 1u, N, q, y1); }
        if (nr > 2u) { rows_store(t0 + 2u, N, q, y2); }
        if (nr > 3u) { rows_store(t0 + 3u, N, q, y3); }
    }
}

// u values (rows t0 .. t0 + 3) of u's column j into workgroup memory
fn put_ur(j: u32, v: vec4<f32>) {
    wur[j / 4u][j % 4u] = v.x;
    wur[UJ + j / 4u][j % 4u] = v.y;
    wur[2u * UJ + j / 4u][j % 4u] = v.z;
    wur[3u * UJ + j / 4u][j % 4u] = v.w;
}

// a row's 4 expand sums (rows 4q, 4q + 1 from u at ua, 4q + 2, 4q + 3 at ub), its u at o in wur
fn rows_expand(acc: vec4<f32>, o: u32, ua: u32, ub: u32, w0: wf, w1: wf, w2: wf, w3: wf) -> vec4<f32> {
    let u0 = wur[o + ua];
    let u1 = wur[o + ua + (VW / 4u - 1u)];
    let u2 = wur[o + ub];
    let u3 = wur[o + ub + (VW / 4u - 1u)];
    return vec4<f32>(wdotf(acc.x, u0, u1, w0), wdotf(acc.y, u0, u1, w1), wdotf(acc.z, u2, u3, w2), wdotf(acc.w, u2, u3, w3));
}

fn rows_store(t: u32, N: u32, q: u32, v: vec4<f32>) {
    let o = (D.y_off + t * N) / 4u + q;
    if (STORE) {
        yv[o] = act4(v);
    } else {
        yv[o] = act4(vec4<f32>(yv[o]) + v);
    }
}

struct Acc3 { x: vec4<f32>, y: vec4<f32>, z: vec4<f32> }

// one A load of each target (row l's VW values at ak, ak + RK, ak + 2 RK) against the 4 rows' x
// values (xa: the first 4, xb: the second 4 where VW = 8), as delta_row adds them
fn rows_mac(c: Acc3, xa0: vec4<f32>, xb0: vec4<f32>, xa1: vec4<f32>, xb1: vec4<f32>, xa2: vec4<f32>, xb2: vec4<f32>,
            xa3: vec4<f32>, xb3: vec4<f32>, ak: u32, RK: u32, NT: u32) -> Acc3 {
    var r = c;
    let w0 = wunpack(a4[ak]);
    r.x = vec4<f32>(wdotf(r.x.x, xa0, xb0, w0), wdotf(r.x.y, xa1, xb1, w0), wdotf(r.x.z, xa2, xb2, w0),
                    wdotf(r.x.w, xa3, xb3, w0));
    if (NT > 1u) {
        let w1 = wunpack(a4[ak + RK]);
        r.y = vec4<f32>(wdotf(r.y.x, xa0, xb0, w1), wdotf(r.y.y, xa1, xb1, w1), wdotf(r.y.z, xa2, xb2, w1),
                        wdotf(r.y.w, xa3, xb3, w1));
    }
    if (NT > 2u) {
        let w2 = wunpack(a4[ak + 2u * RK]);
        r.z = vec4<f32>(wdotf(r.z.x, xa0, xb0, w2), wdotf(r.z.y, xa1, xb1, w2), wdotf(r.z.z, xa2, xb2, w2),
                        wdotf(r.z.w, xa3, xb3, w2));
    }
    return r;
}
