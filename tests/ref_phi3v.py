"""A numpy reference of Phi-3.5-vision's image embedding as mlc-llm defines it (model/phi3v:
phi3v_model.py image_preprocess, phi3v_image.py Phi3ImageEmbedding; model/vision: clip_vision.py,
image_processing.py) at the sizes WebLLM passes (llm_chat.ts calculateResizeShape / CropShape),
written from that code's steps (its reshapes and concatenations), not from the engine's.
transformers has no Phi-3-vision of its own (it was remote code): its CLIPVisionModel checks the
tower alone (tests/fixtures/make_phi3v.py)."""
from __future__ import annotations

import math

import numpy as np

MEAN = np.array([0.48145466, 0.4578275, 0.40821073], np.float32)
STD = np.array([0.26862954, 0.26130258, 0.27577711], np.float32)


def resize_shape(h: int, w: int, hd_num: int = 16) -> tuple[int, int]:
    ratio = w / h
    scale = 1
    while scale * math.ceil(scale / ratio) <= hd_num:
        scale += 1
    scale -= 1
    return math.floor(scale * 336 / ratio), scale * 336


def resize2d_linear(img: np.ndarray, out_h: int, out_w: int) -> np.ndarray:
    """topi's _resize_2d (linear, half_pixel) of (C, H, W), an output row at a time, f32."""
    C, H, W = img.shape
    img = img.astype(np.float32)
    out = np.empty((C, out_h, out_w), np.float32)
    sx = np.float32(W) / np.float32(out_w)
    in_x = (np.arange(out_w, dtype=np.float32) + np.float32(0.5)) * sx - np.float32(0.5)
    x_int = np.floor(in_x).astype(np.int64)
    x_lerp = in_x - x_int.astype(np.float32)
    xa, xb = np.clip(x_int, 0, W - 1), np.clip(x_int + 1, 0, W - 1)
    sy = np.float32(H) / np.float32(out_h)
    for y in range(out_h):
        in_y = (np.float32(y) + np.float32(0.5)) * sy - np.float32(0.5)
        y_int = int(np.floor(in_y))
        y_lerp = np.float32(in_y - np.float32(y_int))
        ya, yb = min(max(y_int, 0), H - 1), min(max(y_int + 1, 0), H - 1)
        top = img[:, ya, xa] * (np.float32(1) - x_lerp) + img[:, ya, xb] * x_lerp
        bottom = img[:, yb, xa] * (np.float32(1) - x_lerp) + img[:, yb, xb] * x_lerp
        out[:, y] = top * (np.float32(1) - y_lerp) + bottom * y_lerp
    return out


def image_preprocess(rgb: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(combined (1 + h w, 3, 336, 336), h_crop, w_crop) of an (H, W, 3) u8 picture."""
    H, W, _ = rgb.shape
    rh, rw = resize_shape(H, W)
    x = resize2d_linear(rgb.transpose(2, 0, 1), rh, rw).astype(np.uint32).astype(np.float32)
    tar = (rh + 335) // 336 * 336
    t = (tar - rh) // 2
    padded = np.full((3, tar, rw), 255, np.float32)
    padded[:, t:t + rh] = x
    x = padded * np.float32(1 / 255.0)
    x = (x - MEAN[:, None, None]) / STD[:, None, None]
    glb = resize2d_linear(x, 336, 336)
    h = tar // 336
    crops = x.reshape(1, 3, h, 336, rw // 336, 336).transpose(0, 2, 4, 1, 3, 5).reshape(-1, 3, 336, 336)
    return np.concatenate([glb[None], crops]), h, rw // 336


def layer_norm(x, w, b, eps):
    m = x.mean(-1, keepdims=True)
    v = ((x - m) ** 2).mean(-1, keepdims=True)
    return (x - m) / np.sqrt(v + eps) * w + b


def clip_tower(px: np.ndarray, w: dict, cfg: dict) -> np.ndarray:
    """CLIPVisionModel.forward as MLC's: encoder_states[-2] (the second to last layer's output, no
    post-layernorm), the class row dropped by get_img_features: (B, N, C)."""
    B, p, C, H = px.shape[0], cfg["patch_size"], cfg["hidden_size"], cfg["num_attention_heads"]
    P = px.shape[-1] // p
    conv = w["embeddings.patch_embedding.weight"].reshape(C, -1)
    unf = px.reshape(B, 3, P, p, P, p).transpose(0, 2, 4, 1, 3, 5).reshape(B, P * P, -1)
    x = unf.astype(np.float64) @ conv.T
    cls = np.broadcast_to(w["embeddings.class_embedding"], (B, 1, C))
    x = np.concatenate([cls, x], axis=1) + w["embeddings.position_embedding.weight"][None]
    x = layer_norm(x, w["pre_layrnorm.weight"], w["pre_layrnorm.bias"], cfg["layer_norm_eps"])
    states = [x]
    D = C // H
    for i in range(cfg["num_hidden_layers"]):
        L = f"encoder.layers.{i}."

        def lin(h, n):
            return h @ w[L + n + ".weight"].T + w[L + n + ".bias"]
        h = layer_norm(x, w[L + "layer_norm1.weight"], w[L + "layer_norm1.bias"], cfg["layer_norm_eps"])
        q, k, v = (lin(h, f"self_attn.{n}_proj").reshape(B, -1, H, D).transpose(0, 2, 1, 3) for n in "qkv")
        s = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
        a = np.exp(s - s.max(-1, keepdims=True))
        a = (a / a.sum(-1, keepdims=True)) @ v
        x = x + lin(a.transpose(0, 2, 1, 3).reshape(B, -1, C), "self_attn.out_proj")
        h = layer_norm(x, w[L + "layer_norm2.weight"], w[L + "layer_norm2.bias"], cfg["layer_norm_eps"])
        f = lin(h, "mlp.fc1")
        x = x + lin(f / (1 + np.exp(-1.702 * f)), "mlp.fc2")
        states.append(x)
    return states[-2][:, 1:]


def _merge(feats: np.ndarray, h_crop: int, w_crop: int) -> np.ndarray:
    """reshape_hd_patches_2x2merge: (N, L, C) -> (1, h_crop H/2, w_crop H/2, 4C)."""
    N, L, C = feats.shape
    H = int(L ** 0.5)
    f = feats.reshape(N, H // 2, 2, H // 2, 2, C).transpose(0, 1, 3, 2, 4, 5).reshape(N, -1, 4 * C)
    f = f.reshape(1, h_crop, w_crop, H // 2, H // 2, -1).transpose(0, 1, 3, 2, 4, 5)
    return f.reshape(1, h_crop * H // 2, w_crop * H // 2, 4 * C)


def _newline(f: np.ndarray, sub_gn: np.ndarray) -> np.ndarray:
    n, h, w, c = f.shape
    return np.concatenate([f, np.broadcast_to(sub_gn.reshape(1, 1, 1, c), (n, h, 1, c))], axis=2).reshape(n, -1, c)


def gelu(x):
    return 0.5 * x * (1 + np.vectorize(math.erf)(x / math.sqrt(2)))


def image_embed(rgb: np.ndarray, tower_w: dict, tower_cfg: dict, proj: dict) -> np.ndarray:
    """Phi3ImageEmbedding.forward of one picture: (rows, C_text) float64. proj: glb_GN, sub_GN,
    linear_1 / linear_2 .weight / .bias as float arrays."""
    combined, h, w = image_preprocess(rgb)
    cfg = {**tower_cfg, "num_hidden_layers": tower_cfg["num_hidden_layers"]}
    feats = clip_tower(combined, tower_w, cfg)
    glb = _newline(_merge(feats[:1], 1, 1), proj["sub_GN"])
    sub = _newline(_merge(feats[1:1 + h * w], h, w), proj["sub_GN"])
    x = np.concatenate([sub, proj["glb_GN"].reshape(1, 1, -1), glb], axis=1)[0]
    x = gelu(x @ proj["linear_1.weight"].T + proj["linear_1.bias"])
    return x @ proj["linear_2.weight"].T + proj["linear_2.bias"]


def n_rows(h_img: int, w_img: int, half: int) -> int:
    """WebLLM's computeImageEmbedSize at a tower of 2 half x 2 half patches."""
    rh, rw = resize_shape(h_img, w_img)
    hc, wc = (rh + 335) // 336, rw // 336
    return hc * half * (wc * half + 1) + 1 + half * (half + 1)
