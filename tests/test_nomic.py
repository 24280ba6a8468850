"""NomicBert (nomic-embed-text v1/v1.5) on the real adapter against a numpy reference (tests/ref_nomic.py:
its modelling code is remote code on the hub, which transformers cannot build offline)."""
from __future__ import annotations

import numpy as np
import pytest

import ref_nomic as R
from tiny_encoders import write_tiny_nomic
from webgpu_engine.config import ChatConfig
from webgpu_engine.errors import UnsupportedModelError
from webgpu_engine.loaders.hf_config import nomic_config_from_dict
from webgpu_engine.models.registry import open_model
from webgpu_engine.pipelines.embedding import EmbeddingPipeline

TEXTS = ["the quick brown fox", "hello world, the web gpu engine runs fast " * 4, "a",
         "café in paris is the capital of france", "cat " * 90]        # the last: truncated to 64


def test_rotate_matches_the_remote_code_formula():
    """The reference's rotation is nomic's apply_rotary_emb (non-interleaved): x·cos + rotate_half(x)·sin."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, 2, 8))
    inv = 1.0 / (1000.0 ** (np.arange(0, 8, 2) / 8))
    ang = np.arange(7)[:, None] * inv
    cos, sin = np.tile(np.cos(ang), 2)[:, None], np.tile(np.sin(ang), 2)[:, None]
    rotate_half = np.concatenate([-x[..., 4:], x[..., :4]], -1)
    assert np.allclose(R.rotate(x, 1000.0, 8), x * cos + rotate_half * sin)


def test_config_refuses_what_it_does_not_run():
    cfg = {"n_embd": 64, "n_head": 4, "n_layer": 2, "vocab_size": 100, "rotary_emb_fraction": 1.0}
    c = nomic_config_from_dict(cfg)
    assert (c.arch, c.rope_base, c.rot_dim, c.ffn, c.max_position) == ("nomic_bert", 10000.0, 16, "swiglu", 2048)
    assert nomic_config_from_dict({**cfg, "rotary_scaling_factor": 2.0, "n_positions": 8192}).max_position == 2048
    for bad in ({"prenorm": True}, {"rotary_emb_interleaved": True}, {"activation_function": "geglu"},
                {"rotary_emb_fraction": 0.0}):
        with pytest.raises(UnsupportedModelError):
            nomic_config_from_dict({**cfg, **bad})


@pytest.fixture(scope="module", params=[1.0, 0.5], ids=["rotary-full", "rotary-half"])
def tiny(request, tmp_path_factory, device):
    import asyncio
    info = write_tiny_nomic(tmp_path_factory.mktemp("nomic"), rotary_fraction=request.param)
    pipe = asyncio.run(EmbeddingPipeline.load(device, info["folder"], ChatConfig(max_batch_size=2)))
    yield info, pipe
    pipe.dispose()


async def test_tiny_nomic_matches_numpy(tiny):
    info, pipe = tiny
    m = open_model(info["folder"])
    m.close()
    assert m.arch.name == "nomic_bert" and m.extra.pooling == "mean" and m.extra.normalize
    W, cfg = R.load_weights(info["folder"]), R.load_config(info["folder"])
    ids = pipe.tokenize(TEXTS)
    assert max(len(i) for i in ids) == 64 and pipe.max_seq_length == 64
    res = await pipe.embed_step(TEXTS)               # batches of 2: mixed lengths padded together
    for text, s, got in zip(TEXTS, ids, res.embeddings):
        ref = R.embed(W, cfg, s)
        g = np.asarray(got)
        assert g @ ref / np.linalg.norm(g) / np.linalg.norm(ref) > 0.9999, text[:30]
        assert np.abs(g - ref).max() < 1e-4, text[:30]
