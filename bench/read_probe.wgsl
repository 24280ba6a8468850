// read_probe.wgsl: the adapter's read bandwidth (bench/ceilings.py, not an engine kernel). Each
// workgroup reads its own run of RP.per vec4 words of src4, its 64 lanes 64 consecutive words a step
// (1 KiB, as the decode matmul's lanes read their weight spans side by side), and stores one sum per
// lane so that no read is dead: a kernel that reads much and writes little, as decode's matmuls do.

struct ReadParams { per: u32, _a: u32, _b: u32, _c: u32 }   // per: vec4 words per workgroup, a multiple of 64

@group(0) @binding(0) var<uniform> RP: ReadParams;
@group(0) @binding(1) var<storage, read> src4: array<vec4<u32>>;     // (groups * per)
@group(0) @binding(2) var<storage, read_write> sums: array<u32>;     // (groups * 64)

// read_probe: sums[g, l] = sum of lane l's words   dispatch (groups, 1, 1), workgroup 64
@compute @workgroup_size(64)
fn read_probe(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {
    let base = wid.x * RP.per + lid;
    var a0 = vec4<u32>(0u);
    var a1 = vec4<u32>(0u);
    for (var j = 0u; j < RP.per; j += 128u) {
        a0 += src4[base + j];
        a1 += src4[base + j + 64u];
    }
    let s = a0 + a1;
    sums[wid.x * 64u + lid] = s.x + s.y + s.z + s.w;
}
