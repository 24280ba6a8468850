// matmul_batch ("rows" variant of kernels/matmul_batch.py): y[t, n0 + r] (+)= sum_k x[t, k] * W[r, k]
// (+ bias[n0 + r]) for a small batch of activation rows t < T (2..16: one decode step of several
// sequences), f32 accumulation.
// dispatch (ceil(rows / (WG * RR)), 1, 1), workgroup WG.
//
// Why: a decode step streams every weight once; the row kernels stream and decode each weight once
// per activation row. Here invocation i owns RR weight rows and all T activation rows: each
// 32-weight chunk is read and decoded ONCE into registers (`wchunk`, from the weight type's file:
// matmul_<dtype>.wgsl, or matmul_words.wgsl with dequant.wgsl) and dotted with the T rows of x.
// No barriers, no workgroup memory; x words are the same for every invocation of a workgroup, so a
// GPU broadcasts them (CPU drivers gather them lane by lane inside the K loop: there the "tiled"
// variant wins).
//
// Per row the sums are those of the T = 1 kernels (matmul_decode.wgsl / matmul.wgsl row_sums):
// a[t][r] += cdot(wchunk(row r, c), xchunk(row t, c)) for c = 0, 1, ... in order, then the K % 32
// tail, so a row's result does not depend on what else is in the batch, and is the one it gets
// alone wherever the compiler contracts both kernels' arithmetic alike.
//
// Built after matmul.wgsl (WChunk, XChunk, xchunk, cdot, tail, store, P and the x / y / bias
// bindings) and before one weight file. The host adds consts XR0.. (x row offsets in xword units)
// and generates the entry point `matmul_batch`: bat_rows, then a loop over the chunks c with the RR
// decodes and T x RR `cdot`s, then bat_tail (K % 32 != 0) and bat_store per activation row.

// the RR weight rows' first words; rows past the end re-read the last row and are not stored
// (no early return: every load would sit inside control flow)
struct BatRows { b: vec4<u32>, r0: u32 }

fn bat_rows(wid: vec3<u32>, lid: u32) -> BatRows {
    let r0 = (wid.x * WG + lid) * RR;
    let last = P.rows - 1u;
    return BatRows(vec4<u32>(min(r0, last), min(r0 + 1u, last), min(r0 + 2u, last),
                             min(r0 + 3u, last)) * P.row_words, r0);
}

// the K % 32 tail of float weights for the RR rows and the x row starting at xr
fn bat_tail(rows: BatRows, xr: u32, a: vec4<f32>) -> vec4<f32> {
    var s = a;
    s.x += tail(rows.b.x, xr);
    if (RR > 1u) { s.y += tail(rows.b.y, xr); }
    if (RR > 2u) { s.z += tail(rows.b.z, xr); s.w += tail(rows.b.w, xr); }
    return s;
}

fn bat_store(t: u32, rows: BatRows, a: vec4<f32>) {
    store(t, rows.r0, a.x);
    if (RR > 1u) { store(t, rows.r0 + 1u, a.y); }
    if (RR > 2u) { store(t, rows.r0 + 2u, a.z); store(t, rows.r0 + 3u, a.w); }
}
