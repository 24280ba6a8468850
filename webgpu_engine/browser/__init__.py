"""Page-side glue for running the engine inside Pyodide: `app` (the entry point the demo page calls),
`artifact_cache` (Cache API, WebLLM-like scopes), `selftest` (the gpu backend checked in the page).
Standard library only at module level (no numpy, pydantic or tokenizers in the page)."""
