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
// Built after matmul.wgsl (WChunk, XChunk, xchunk, cdot, tail, row_group, store4, P; matmul_io.wgsl's
// x / y / bias bindings and store) and before one weight file. The host adds consts XR0.. (x row offsets in xword units)
// and generates the entry point `matmul_batch`: matmul.wgsl's row_group, then a loop over the chunks
// c with the RR decodes and T x RR `cdot`s, then bat_tail (K % 32 != 0) and store4 per activation row.

// the K % 32 tail of float weights for the RR rows and the x row starting at xr
fn bat_tail(rows: RowGroup, xr: u32, a: vec4<f32>) -> vec4<f32> {
    var s = a;
    s.x += tail(rows.b.x, xr);
    if (RR > 1u) { s.y += tail(rows.b.y, xr); }
    if (RR > 2u) { s.z += tail(rows.b.z, xr); s.w += tail(rows.b.w, xr); }
    return s;
}
