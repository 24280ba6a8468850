// causal_conv1d: Gated DeltaNet's short convolution. Each channel c of a sequence's rows goes through
// a causal depthwise convolution of K taps and SiLU, starting from the sequence's state (its last K-1
// inputs) and leaving the state at the last K-1 inputs it saw:
//   xs = (state[slot, c, 0 .. K-2], x[rows of the sequence, c]);  y[t, c] = silu(sum_j w[c, j] * xs[t + j])
// Consecutive rows with the same slot are one sequence in order; a sequence whose first row here is
// at position 0 starts from zeros. Positions and slots: pos0 + t and slot 0 from `step` (per_row 0,
// one sequence), or positions[t] and slots[t] (per_row 1: the paged batch's rows).
// dispatch (ceil(C / 64), 1, 1), workgroup 64: one invocation per channel, its rows in order.
// A row whose slots entry also names a save slot (row_save(t) = that slot + 1; per_row 1 only) copies
// the state after it there: a snapshot of the sequence at that position (models/recurrent_snapshots.py).
// row_pos(t), row_slot(t), row_save(t): each row's position, slot and save slot, in the header
// (kernels/deltanet.py).

struct Params {
    rows: u32,          // T
    channels: u32,      // C
    taps: u32,          // K <= 8
    x_stride: u32,      // elements per row of x (the channels are its first C columns)
    x_off: u32,         // element offsets of x and y in their bindings
    y_off: u32,
    per_row: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<act>;                // (T, x_stride)
@group(0) @binding(2) var<storage, read> w: array<f32>;                // (C, K)
@group(0) @binding(3) var<storage, read_write> state: array<f32>;      // (slots, C, K-1)
@group(0) @binding(4) var<storage, read_write> y: array<act>;          // (T, C)
@group(0) @binding(5) var<storage, read> step: array<u32>;             // (4): pos0, n_new, kv_len, 0
@group(0) @binding(6) var<storage, read> positions: array<u32>;        // (T,) per_row 1
@group(0) @binding(7) var<storage, read> slots: array<u32>;            // (T,) per_row 1: slot | (save + 1) << 16

@compute @workgroup_size(64)
fn causal_conv1d(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    if (c >= p.channels) { return; }
    let k1 = p.taps - 1u;
    var win: array<f32, 8>;             // the last K-1 inputs, oldest first
    for (var t = 0u; t < p.rows; t++) {
        let slot = row_slot(t);
        let base = (slot * p.channels + c) * k1;
        if (t == 0u || row_slot(t - 1u) != slot) {          // the sequence's first row here
            let fresh = row_pos(t) == 0u;
            for (var j = 0u; j < k1; j++) { win[j] = select(state[base + j], 0.0, fresh); }
        }
        let xv = f32(x[p.x_off + t * p.x_stride + c]);
        var acc = 0.0;
        for (var j = 0u; j < k1; j++) { acc += w[c * p.taps + j] * win[j]; }
        acc += w[c * p.taps + k1] * xv;
        y[p.y_off + t * p.channels + c] = act(acc / (1.0 + exp(-acc)));
        for (var j = 0u; j + 1u < k1; j++) { win[j] = win[j + 1u]; }
        if (k1 > 0u) { win[k1 - 1u] = xv; }
        let save = row_save(t);
        if (save != 0u) {
            for (var j = 0u; j < k1; j++) { state[((save - 1u) * p.channels + c) * k1 + j] = win[j]; }
        }
        if (t + 1u == p.rows || row_slot(t + 1u) != slot) {  // its last row here: keep the state
            for (var j = 0u; j < k1; j++) { state[base + j] = win[j]; }
        }
    }
}
