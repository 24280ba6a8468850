// saxpy: y[i] = A * x[i] + y[i]   (A: pipeline-overridable constant)   dispatch (ceil(N/64),1,1), workgroup 64
// Used by the browser backend's self-test; `alias act` comes from the header (act_header("f32")).

override A: f32 = 2.0;

@group(0) @binding(0) var<storage, read> x: array<act>;         // (N)
@group(0) @binding(1) var<storage, read_write> y: array<act>;   // (N)

@compute @workgroup_size(64)
fn saxpy(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < arrayLength(&y)) {
        y[i] = act(A) * x[i] + y[i];
    }
}
