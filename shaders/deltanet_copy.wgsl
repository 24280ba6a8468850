// state_copy: whole slots of a recurrent state buffer (Gated DeltaNet's conv or delta states, one
// slot per sequence or snapshot) copied to other slots, for each pair k of `pairs`:
//   state[dst_k, :] = state[src_k, :]                  a slot: slot_elems f32
// (a snapshot restored into a sequence's slot: models/recurrent_snapshots.py). pairs = (count, src_0,
// dst_0, src_1, dst_1, ..): pairs past count are left; no pair reads a slot another writes. A copy
// between slots of one buffer needs a kernel: WebGPU's copyBufferToBuffer takes two buffers.
// dispatch (ceil(slot_elems / 256), max_pairs, 1), workgroup 64: 4 elements an invocation.

struct Params {
    slot_elems: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> state: array<f32>;      // (slots, slot_elems)
@group(0) @binding(2) var<storage, read> pairs: array<u32>;            // (1 + 2 max_pairs,)

@compute @workgroup_size(64)
fn state_copy(@builtin(global_invocation_id) gid: vec3<u32>) {
    let k = gid.y;
    if (k >= pairs[0]) { return; }
    let src = pairs[1u + 2u * k] * p.slot_elems;
    let dst = pairs[2u + 2u * k] * p.slot_elems;
    let end = min(gid.x * 4u + 4u, p.slot_elems);
    for (var i = gid.x * 4u; i < end; i++) { state[dst + i] = state[src + i]; }
}
