"""loaders layer: model file headers and tokenizers (stdlib-only at import; runs in the browser too).

- `gguf.GGUFFile(path | buffer)`: metadata, `tensors`, `weights()` (our names), `model_config()`,
  `tokenizer()`, `template()`.
- `safetensors.SafetensorsFolder(folder)`: `tensors` (HF names), `weights("llama" | "bert")`;
  `hf_config.load_llama_config` / `load_bert_config` read config.json.
- `decoder_config`: the decoder families' shared reading of GGUF metadata and config.json, and the
  `DecoderFamily` records the families' modules (models/family_*.py) register with it.
- `tokenizer.load_tokenizer(GGUFFile | metadata | folder)`: byte-level BPE (`bpe`) or WordPiece
  (`wordpiece`), through the `tokenizers` library natively when it imports.
- `chat_template.ChatTemplate`: the model's Jinja chat template, rendered as transformers does.
Our weight names (shared by every format): embed, norm, lm_head, layers.{i}.attn_norm, .q .k .v
(.q_bias .k_bias .v_bias), .o, .ffn_norm, .gate, .up, .down — see GGUF_TO_OURS / HF_LLAMA_TO_OURS.
"""
