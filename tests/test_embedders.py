"""Embedders beyond plain BERT: OpenAI `dimensions` for Matryoshka models, through the official
openai client against the real server (a tiny Matryoshka BERT and the default MiniLM, which is not
trained for truncation)."""
from __future__ import annotations

import math

import numpy as np
import openai
import pytest

from tinymodels import write_tiny_bert
from webgpu_engine.loaders.sentence_transformers import (load_sentence_transformer_config,
                                                         model_card_says_matryoshka)
from webgpu_engine.server.app import ServerOptions, ServerThread

MATRYOSHKA_CARD = """---
tags:
- sentence-transformers
- sentence-similarity
- loss:MatryoshkaLoss
pipeline_tag: sentence-similarity
---
# tiny
"""


def test_model_card_front_matter_decides_matryoshka(tmp_path):
    write_tiny_bert(tmp_path)
    assert not model_card_says_matryoshka(tmp_path)
    (tmp_path / "README.md").write_text("---\ntags:\n- sentence-transformers\n---\nUnlike Matryoshka "
                                        "models, this one\n- matryoshka\n")      # prose only: no
    assert not load_sentence_transformer_config(tmp_path).matryoshka
    (tmp_path / "README.md").write_text(MATRYOSHKA_CARD)
    assert load_sentence_transformer_config(tmp_path).matryoshka
    (tmp_path / "README.md").write_text("---\ntags:\n  - 'Matryoshka'\n---\n")
    assert model_card_says_matryoshka(tmp_path)


@pytest.fixture(scope="module")
def served(tmp_path_factory, minilm_dir, device):
    folder = tmp_path_factory.mktemp("emb") / "tiny-mrl"
    write_tiny_bert(folder, normalize=True, hidden_size=64)
    (folder / "README.md").write_text(MATRYOSHKA_CARD)
    s = ServerThread(ServerOptions(models=[str(folder), str(minilm_dir)], port=0))   # ids: the folder names
    yield s, openai.OpenAI(base_url=s.url, api_key="none", max_retries=0)
    s.stop()


def test_dimensions_truncates_and_renormalises_a_matryoshka_model(served):
    _, c = served
    texts = ["the cat sat on the mat", "hello world"]
    full = c.embeddings.create(model="tiny-mrl", input=texts)
    assert len(full.data[0].embedding) == 64
    for dims, fmt in ((16, openai.NOT_GIVEN), (63, "float"), (64, "float")):   # not given: base64 on the wire
        short = c.embeddings.create(model="tiny-mrl", input=texts, dimensions=dims, encoding_format=fmt)
        for f, s in zip(full.data, short.data):
            v = np.asarray(f.embedding[:dims], np.float64)
            assert len(s.embedding) == dims
            assert math.isclose(float(np.linalg.norm(s.embedding)), 1.0, abs_tol=1e-5)
            assert np.abs(np.asarray(s.embedding) - v / np.linalg.norm(v)).max() < 1e-6
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="tiny-mrl", input="a", dimensions=65)
    assert e.value.status_code == 400 and e.value.body["param"] == "dimensions"
    assert "between 1 and 64" in e.value.body["message"]


def test_dimensions_is_refused_for_minilm(served):
    _, c = served
    with pytest.raises(openai.BadRequestError) as e:
        c.embeddings.create(model="all-MiniLM-L6-v2", input="a cat", dimensions=128)
    assert e.value.status_code == 400 and e.value.body["param"] == "dimensions"
    assert "Model all-MiniLM-L6-v2 does not support `dimensions`" in e.value.body["message"]
    # its own width is no truncation, so it is accepted; and the model still serves afterwards
    assert len(c.embeddings.create(model="all-MiniLM-L6-v2", input="a", dimensions=384).data[0].embedding) == 384
    with pytest.raises(openai.BadRequestError):
        c.embeddings.create(model="all-MiniLM-L6-v2", input="a", dimensions=0)
