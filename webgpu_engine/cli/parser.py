"""The argument parser of `python -m webgpu_engine`: one subcommand per command, its options and help.
Importing it is light (no engine, server or cache import), so `--help` stays fast."""
from __future__ import annotations

import argparse
import os
import sys

from ..catalogue import DEFAULT_CHAT_MODEL, DEFAULT_EMBED_MODEL
from .argtypes import count
from .commands import cmd_bench, cmd_chat, cmd_complete, cmd_embed, cmd_info, cmd_serve
from .structured import add_options as add_structured_options
from .listing import add_subcommand as add_list_command
from .ray_cmds import add_embed_corpus_command, add_serve_options as add_ray_serve_options
from .tune import add_subcommand as add_tune_command

REF = ("a model: an app-config id, a .gguf file, a model folder, a URL, a Hugging Face ORG/REPO[:QUANT] "
       "or ollama:NAME[:TAG] (Ollama's store)")


# --------------------------------------------------------------------------- parser
def _missing_cache_cli(name: str):
    def run(args) -> int:
        print(f"error: `{name}` needs the artifact cache layer (webgpu_engine.cache.cli), which is not "
              f"available in this installation.", file=sys.stderr)
        return 1
    return run


def _download_references(p) -> None:
    """`download` takes model references too: what the artifact cache does not know is resolved, which
    fetches it (a Hugging Face repo into the Hugging Face cache, a URL into the artifact cache)."""
    cache_download = p.get_default("func")
    p.description += (" A MODEL_ID may also be any model reference: a URL or a Hugging Face "
                      "ORG/REPO[:QUANT] (fetched into the Hugging Face cache).")

    def run(args) -> int:
        from ..cache import known_models
        from ..engine.references import resolve_model_reference
        known = known_models()
        refs = [m for m in args.model_id if m not in known]
        if len(refs) < len(args.model_id) or not refs:
            args.model_id = [m for m in args.model_id if m in known]
            rc = cache_download(args)
            if rc:
                return rc
        if args.root:           # URLs go to the artifact cache: the one --root names
            os.environ["WEBGPU_ENGINE_CACHE"] = args.root
        for ref in refs:
            rec = resolve_model_reference(ref, offline=args.offline or None)
            print(f"{ref}: {rec.model}")
        return 0
    p.set_defaults(func=run)


def _add_cache_commands(sub) -> None:
    """`download` and `cache` belong to the cache layer; it registers them when present."""
    try:
        from ..cache import cli as cache_cli
        cache_cli.add_subcommands(sub)
        _download_references(sub.choices["download"])
        return
    except (ImportError, AttributeError):
        pass
    for name, text in (("download", "fetch a model's artifacts into the local cache"),
                       ("cache", "list or delete cached artifacts")):
        p = sub.add_parser(name, help=text + " (needs webgpu_engine.cache.cli)",
                           description=text + ".")
        p.add_argument("rest", nargs=argparse.REMAINDER)
        p.set_defaults(func=_missing_cache_cli(name))


def _lora_option(p) -> None:
    p.add_argument("--lora", default=None, metavar="PATH",
                   help="answer with this LoRA adapter (a PEFT folder or a GGUF LoRA file) over the model")


def _model_options(p, many: bool = False):
    p.add_argument("--model-id", action="append" if many else "store", default=None, metavar="ALIAS",
                   help="the id the model is known by (default: the file, folder or repo name)"
                        + ("; repeatable, one per --model in order" if many else ""))
    p.add_argument("--config", default=None, metavar="APP_CONFIG_JSON",
                   help="WebLLM AppConfig JSON ({\"model_list\": [...]}): its records replace the "
                        "built-in ones" + (" and, without --model, are all served" if many else ""))
    each = "; once for every model, or once per --model in order" if many else ""
    g = p.add_argument_group("load options (WebLLM ChatConfig)")
    g.add_argument("--context-window", type=int, action="append", default=None, metavar="TOKENS",
                   help="KV cache length (default: the model's trained context, at most 4096)" + each)
    g.add_argument("--prefill-chunk", type=int, action="append", default=None, metavar="TOKENS",
                   help="prompt tokens per prefill step (default 256)" + each)
    g.add_argument("--dtype", choices=("auto", "f16", "f32"), action="append", default=None,
                   help="activation precision (auto: f16 where the adapter has shader-f16)" + each)
    g.add_argument("--kv-cache-dtype", choices=("auto", "f16", "f32", "q8_0", "q4_0"), action="append",
                   default=None, help="chat models: KV cache precision (auto: the activations'; q8_0: "
                   "llama.cpp's 8-bit blocks, about half of f16's memory; q4_0: its 4-bit blocks, about "
                   "0.28x)" + each)
    g.add_argument("--max-num-sequences", type=int, action="append", default=None, metavar="N",
                   help="chat models: requests decoded together (continuous batching over a paged KV "
                        "cache; 0: as suits the device, 4 on a CPU adapter (or its measured width) and 16 on a GPU; default: "
                        "serve 0, chat and complete 1)" + each)
    g.add_argument("--context-overflow", choices=("error", "truncate", "shift"), action="append", default=None,
                   help="chat models: a prompt longer than the context window is a 400 (error, the "
                        "default) or loses its oldest turns after the system prompt (truncate); shift: "
                        "as truncate, and a generation reaching the window drops the older half of its "
                        "context and goes on (per sequence, in the batch)" + each)
    g.add_argument("--speculation", choices=("ngram",), action="append", default=None,
                   help="chat models: speculative decoding by prompt lookup (per sequence, in the "
                        "batch: each guesses its own tokens, one step checks them all)" + each)
    g.add_argument("--draft-model", action="append", default=None, metavar="REF",
                   help="chat models: speculative decoding with this smaller model of the same vocabulary "
                        "guessing (an id, path, URL or Hugging Face repo; one request at a time: serve "
                        "then defaults to --max-num-sequences 1)" + each)
    g.add_argument("--mmproj", action="append", default=None, metavar="GGUF",
                   help="chat models from a GGUF: its multimodal projector GGUF (as llama.cpp's --mmproj; "
                        "a folder or Ollama model holding both finds it itself)" + each)
    g.add_argument("--chat-opts", action="append", default=None, metavar="JSON",
                   help="WebLLM ChatOptions as JSON, e.g. '{\"temperature\": 0.2}'" + each)


def _queue_length(text: str) -> int | None:
    """--max-queue: a count >= 0 (0: a request is refused whenever the model is busy) or `none`
    (unbounded), the values EngineConfig.max_queue_length takes."""
    return count(text, 0, none=True)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m webgpu_engine",
        description="LLM and embedding engine on any WebGPU device, with WebLLM's MLCEngine API and "
                    "an OpenAI-compatible server.")
    ap.add_argument("--log-level", default=os.environ.get("WEBGPU_ENGINE_LOG_LEVEL", "WARNING"),
                    help="logging level: DEBUG, INFO, WARNING (default), ERROR")
    sub = ap.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("info", help="show the WebGPU adapter, its features and limits",
                       description="Show the WebGPU adapter this machine offers, its features "
                                   "(shader-f16 ...) and limits, and the built-in models.")
    p.add_argument("--json", action="store_true", help="print the full description as JSON")
    p.add_argument("--all", action="store_true", help="print every limit")
    p.add_argument("--adapter", default=None, help="pick an adapter by name substring")
    p.add_argument("--model", default=None, help=REF + ": show what it resolves to and its memory estimate")
    _model_options(p)
    p.set_defaults(func=cmd_info)

    def sampling(p, max_tokens):
        p.add_argument("--max-tokens", type=int, default=max_tokens, help=f"default {max_tokens}")
        p.add_argument("--temperature", type=float, default=None,
                       help="sampling temperature (0 = greedy; default: the model's)")
        p.add_argument("--seed", type=int, default=None, help="random seed for reproducible sampling")
        p.add_argument("--quiet", action="store_true", help="no load progress on stderr")

    p = sub.add_parser("chat", help="interactive streaming chat with an LLM",
                       description="Chat with an LLM, streaming its answers. Multi-turn; /reset starts "
                                   "over, /stats prints speed, /exit (or Ctrl-D) quits. With PROMPT, "
                                   "answers once and exits.")
    p.add_argument("--model", default=DEFAULT_CHAT_MODEL, help=f"{REF} (default {DEFAULT_CHAT_MODEL})")
    _model_options(p)
    _lora_option(p)
    p.add_argument("--system", default=None, help="system message")
    sampling(p, 256)
    add_structured_options(p)
    p.add_argument("--image", action="append", default=None, metavar="PATH",
                   help="an image file sent with the first message (repeat for several; a vision-language "
                        "model such as Gemma 3)")
    p.add_argument("prompt", nargs="*", default=None, help="one-shot prompt (optional)")
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("complete", help="raw text completion (no chat template)",
                       description="Continue PROMPT with the model (no chat template) and print it.")
    p.add_argument("--model", default=DEFAULT_CHAT_MODEL, help=f"{REF} (default {DEFAULT_CHAT_MODEL})")
    _model_options(p)
    _lora_option(p)
    p.add_argument("--echo", action="store_true", help="print the prompt before the completion")
    sampling(p, 64)
    p.add_argument("prompt", nargs="+", help="text to continue")
    p.set_defaults(func=cmd_complete)

    p = sub.add_parser("embed", help="embed texts (vectors or cosine similarities)",
                       description="Embed each TEXT and print its vector as JSON lines, or with "
                                   "--similarity the matrix of cosine similarities.")
    p.add_argument("--model", default=DEFAULT_EMBED_MODEL, help=f"{REF} (default {DEFAULT_EMBED_MODEL})")
    _model_options(p)
    p.add_argument("--similarity", "-s", action="store_true", help="print cosine similarities")
    p.add_argument("--quiet", action="store_true", help="no load progress on stderr")
    p.add_argument("text", nargs="+", help="texts to embed")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server",
                       description="Serve /v1/chat/completions, /v1/completions, /v1/embeddings, "
                                   "/v1/models, /health and /metrics over HTTP.")
    p.add_argument("--model", action="append", default=None,
                   help=f"{REF} (repeatable; default {DEFAULT_CHAT_MODEL} and {DEFAULT_EMBED_MODEL})")
    _model_options(p, many=True)
    p.add_argument("--lora", action="append", default=None, metavar="NAME=PATH",
                   help="a LoRA adapter (a PEFT folder or a GGUF LoRA file) over the chat model, served as "
                        "model NAME (repeatable)")
    p.add_argument("--max-lora-rank", "--lora-max-rank", type=int, default=None, metavar="R",
                   help="the adapters' pool rank (vLLM's --max-lora-rank): a larger adapter is refused; "
                        "several adapters in one request (`lora`) need ranks adding up to at most R "
                        "(default: the largest --lora's, else 16)")
    p.add_argument("--max-loras", type=int, default=None, metavar="N",
                   help="adapters (or adapter + scale entries) held on the GPU at once, the least recently "
                        "used idle one evicted (vLLM's --max-loras; default 4)")
    p.add_argument("--host", default="127.0.0.1", help="default 127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="default 8000")
    p.add_argument("--api-key", default=os.environ.get("WEBGPU_ENGINE_API_KEY"),
                   help="require `Authorization: Bearer KEY` (env WEBGPU_ENGINE_API_KEY)")
    p.add_argument("--max-body-mb", type=float, default=4.0, help="request body size limit (MiB)")
    p.add_argument("--cors-origin", action="append", default=None,
                   help="a browser origin allowed to call the server, e.g. http://localhost:3000 "
                        "(repeatable; `*` allows any; default: none)")
    p.add_argument("--auto-recover", action="store_true",
                   help="after a device loss, reload the models on the next request")
    p.add_argument("--allow-model-management", action="store_true",
                   help="allow POST /v1/models/load and /v1/models/unload (guarded by --api-key)")
    p.add_argument("--max-queue", type=_queue_length, default=32, metavar="N|none",
                   help="requests that may wait for one model while it serves another; more get "
                        "HTTP 429 with Retry-After (default 32; 0: none may wait; none: unbounded), "
                        "as EngineConfig.max_queue_length")
    p.add_argument("--request-timeout", type=float, default=0.0,
                   help="seconds a request may take, queueing included; past it HTTP 504 "
                        "(default 0: no limit)")
    p.add_argument("--shutdown-grace", type=float, default=30.0,
                   help="on SIGTERM, seconds requests in flight may finish before the server exits "
                        "(default 30)")
    # Defaults live in protocol.rules.RequestLimits (not imported here: --help stays light).
    p.add_argument("--max-n", type=int, default=None, help="most choices (`n`) per request (default 16)")
    p.add_argument("--max-stop", type=int, default=None,
                   help="most stop strings per request (default 4, as OpenAI)")
    p.add_argument("--max-logit-bias", type=int, default=None,
                   help="most logit_bias entries per request (default 300, as OpenAI)")
    p.add_argument("--max-embedding-inputs", type=int, default=None,
                   help="most inputs per embeddings request (default 2048, as OpenAI)")
    p.add_argument("--max-embedding-tokens", type=int, default=None,
                   help="most tokens over all inputs of an embeddings request (default 300000, as OpenAI)")
    add_ray_serve_options(p)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("bench", help="run benchmark scripts from bench/",
                       description="Run the benchmark scripts in bench/ (each prints a table and "
                                   "writes JSON). Arguments after -- go to the scripts.")
    p.add_argument("name", nargs="*", help="benchmarks to run (default: all)")
    p.add_argument("--list", action="store_true", help="list the benchmarks")
    p.add_argument("--dir", default="bench", help="folder of the scripts (default bench/)")
    p.set_defaults(func=cmd_bench, extra=[])

    add_embed_corpus_command(sub)
    add_tune_command(sub, DEFAULT_CHAT_MODEL)
    add_list_command(sub)
    _add_cache_commands(sub)
    return ap
