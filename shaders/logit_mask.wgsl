// logit_mask: logits[t] = MASKED for every token t whose bit is clear in the allowed-token bitmask
//   (bit t & 31 of word t >> 5, as llguidance writes it), in place, before the sampler reads the row:
//   a masked token then loses to every allowed one after penalties, bias and temperature.
//   MASKED is finite (-1e30 in f32, -65504 in f16) so that the sampler's arithmetic (repetition
//   penalty, 1/temperature up to 1e5, bucket indices) never meets an infinity or a NaN.
// dispatch (ceil(words / 64), 1, 1), workgroup 64: one invocation per mask word (32 tokens), no barriers.
// Header provides `act` (logits dtype) and MASKED.

struct Params {
  vocab: u32,     // tokens in the row (bits past it are ignored)
  words: u32,     // ceil(vocab / 32)
  _pad0: u32,
  _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> logits: array<act>;   // (V)
@group(0) @binding(2) var<storage, read> mask: array<u32>;           // (ceil(V/32))

@compute @workgroup_size(64)
fn logit_mask(@builtin(global_invocation_id) gid: vec3<u32>) {
  let w = gid.x;
  if (w >= p.words) {
    return;
  }
  let bits = mask[w];
  if (bits == 0xffffffffu) {
    return;
  }
  let t0 = w * 32u;
  let n = min(32u, p.vocab - t0);
  for (var b = 0u; b < n; b++) {
    if (((bits >> b) & 1u) == 0u) {
      logits[t0 + b] = act(MASKED);
    }
  }
}
