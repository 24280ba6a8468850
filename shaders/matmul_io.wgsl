// The row matmuls' activations in and out, written once for matmul.wgsl (and every kernel compiled
// after it) and matmul_tiled.wgsl: the host appends this part to their text (kernels/matmul/codegen.py
// row_source, tiled.py). Their Params P name T, rows, n0, flags, b_off, y_off and y_stride alike.

@group(0) @binding(1) var<storage, read> x: array<xword>;       // (T, K/4) as xword (see xget)
@group(0) @binding(3) var<storage, read_write> y: array<act>;   // (T, N)
@group(0) @binding(4) var<storage, read> bias: array<f32>;      // (N)

// y[t, n0 + r] = sum (+ bias[n0 + r]: flags bit 0) (+ y[t, n0 + r]: bit 1); rows t >= T or r >= rows
// (a tile's spare lanes) store nothing.
fn store(t: u32, r: u32, sum: f32) {
    if (t >= P.T || r >= P.rows) { return; }
    let n = P.n0 + r;
    var v = sum;
    if ((P.flags & 1u) != 0u) { v += bias[P.b_off + n]; }
    let o = P.y_off + t * P.y_stride + n;
    if ((P.flags & 2u) != 0u) { v += f32(y[o]); }
    y[o] = act(v);
}
