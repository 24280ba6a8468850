// sincos / rotate_by: shared by rope.wgsl and the decode matmul's rope epilogue
// (matmul_epilogue.wgsl), so both rotate by exactly the same values.

// sin and cos of an f32 angle, accurate to ~1e-7 for angles up to ~1e5 (long contexts): a
// three-part Cody-Waite reduction by pi/2 and minimax polynomials on [-pi/4, pi/4]. Builtin
// sin/cos only promise ~2^-11 absolute error on [-pi, pi] and nothing outside it.
fn sincos(a: f32) -> vec2<f32> {
    let k = round(a * 0.63661977236758134);
    let r = ((a - k * 1.5703125) - k * 4.837512969970703125e-4) - k * 7.54978995489188216e-8;
    let z = r * r;
    let s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    let c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 +
        z * 2.443315711809948e-5));
    let q = u32(i32(k)) & 3u;
    if (q == 0u) { return vec2<f32>(s, c); }
    if (q == 1u) { return vec2<f32>(c, -s); }
    if (q == 2u) { return vec2<f32>(-s, -c); }
    return vec2<f32>(-c, s);
}

// (a, b) rotated by angle `ang`: (a cos - b sin, a sin + b cos)
fn rotate_by(a: f32, b: f32, ang: f32) -> vec2<f32> {
    let sc = sincos(ang);
    return vec2<f32>(a * sc.y - b * sc.x, a * sc.x + b * sc.y);
}
